package karmada

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"golang.org/x/oauth2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	clusterv1alpha1 "github.com/karmada-io/karmada/pkg/apis/cluster/v1alpha1"

	"github.com/sharedtransport/sharedtransport"
)

// rotatingSecret is a member's Secret whose token is rotated: a token
// source over it reads the token in it now, as Karmada's master re-reads
// the cluster's Secret (PR 7663).
type rotatingSecret struct {
	mu    sync.Mutex
	token string
}

func (s *rotatingSecret) set(token string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.token = token
}

func (s *rotatingSecret) secret(string, string) (*corev1.Secret, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &corev1.Secret{Data: map[string][]byte{
		clusterv1alpha1.SecretTokenKey:  []byte(s.token),
		clusterv1alpha1.SecretCADataKey: kube.ServingCA.CertPEM(),
	}}, nil
}

func (s *rotatingSecret) Token() (*oauth2.Token, error) {
	sec, _ := s.secret("", "")
	return &oauth2.Token{AccessToken: string(sec.Data[clusterv1alpha1.SecretTokenKey]), TokenType: "Bearer", Expiry: time.Now().Add(5 * time.Minute)}, nil
}

// TestTokenSourceRotation: a member config whose token source reads the
// cluster's Secret (rotatingMemberConfig): master's own BuildClusterConfig
// under karmada/hack/test-master.sh, else v1.18.2's with client-go's
// ResettableTokenSourceWrapTransport put together in the shape PR 7663 gives
// master. For a member reached directly and one behind the proxy. The Secret holds a token the member does not know; the first
// list is refused (401); the Secret is rotated to a valid token; the next
// list is refused too and resets the source (client-go keeps a token fetched
// during the request refused); the lists after it carry the new token and
// succeed. Through the pool,
// the wrapper declared as the patched client sets declare it, every answer
// is the one client-go alone gives, request by request, and a second client
// built after the rotation shares the first one's identity and connection
// (behind the proxy: no new tunnel, where client-go alone opens one): the
// token is never identity.
func TestTokenSourceRotation(t *testing.T) {
	for _, viaProxy := range []bool{false, true} {
		for _, pooled := range []bool{false, true} {
			name := map[bool]string{false: "direct", true: "behind the proxy"}[viaProxy] + map[bool]string{false: ", client-go alone", true: ", pool"}[pooled]
			t.Run(name, func(t *testing.T) { tokenRotation(t, viaProxy, pooled) })
		}
	}
}

func tokenRotation(t *testing.T, viaProxy, pooled bool) {
	const cred = "Basic dG9rZW4tcm90YXRpb24="
	m, proxy := newControllerMembers(t, cred)
	if !viaProxy {
		m[cred].Spec.ProxyURL = ""
	}
	sec := &rotatingSecret{token: "not-a-token-of-this-member"}
	pool := sharedtransport.New()
	t.Cleanup(func() { pool.Close() })
	newClient := func() kubernetes.Interface {
		cfg, err := rotatingMemberConfig(cred, m.cluster, sec)
		if err != nil {
			t.Fatal(err)
		}
		var hc *http.Client
		switch {
		case !pooled:
			hc, err = rest.HTTPClientFor(cfg)
		case viaProxy:
			hc, err = pool.HTTPClientFor(cfg, sharedtransport.WithProxyConnectHeader(http.Header{"Proxy-Authorization": {cred}}))
		default:
			hc, err = pool.HTTPClientFor(cfg, sharedtransport.WithPerRequestWrappers())
		}
		if err != nil {
			t.Fatal(err)
		}
		cs, err := kubernetes.NewForConfigAndClient(cfg, hc)
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	list := func(cs kubernetes.Interface) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := cs.CoreV1().ConfigMaps("default").List(ctx, metav1.ListOptions{Limit: 1})
		return err
	}
	cs := newClient()
	if err := list(cs); !apierrors.IsUnauthorized(err) {
		t.Fatalf("a list with a token the member does not know: %v, want 401 Unauthorized", err)
	}
	sec.set(token)
	// client-go keeps a token that was fetched during the request it got a
	// 401 for: the next 401 resets the source, and the list after it has
	// the Secret's new token.
	if err := list(cs); !apierrors.IsUnauthorized(err) {
		t.Fatalf("the list after the Secret rotated, the old token still cached: %v, want 401 Unauthorized", err)
	}
	for i := range 2 {
		if err := list(cs); err != nil {
			t.Fatalf("list %d after the source was reset: %v", i+1, err)
		}
	}
	// Each refused request (401) is followed by a new dial (the pool: 3
	// dials for 2 refusals), so the first client's connections are not
	// counted: the second client, built after the rotation, is.
	tunnels, dials := proxy.Stats().Tunnels, pool.Stats().Dials
	if err := list(newClient()); err != nil {
		t.Fatalf("a client built after the rotation: %v", err)
	}
	if pooled {
		if st := pool.Stats(); st.Identities != 1 || st.PassThrough != 0 || st.Dials != dials {
			t.Errorf("a second client, the token rotated since the first: %d identities, %d passed through, %d new dials; want 1, 0 and 0", st.Identities, st.PassThrough, st.Dials-dials)
		}
	}
	if viaProxy {
		st := proxy.Stats()
		want := tunnels + 1 // client-go alone: a transport per client (Proxy set)
		if pooled {
			want = tunnels
		}
		if st.Tunnels != want || st.Rejected != 0 {
			t.Errorf("a second client: %d new tunnels, %d refused; want %d and 0", st.Tunnels-tunnels, st.Rejected, want-tunnels)
		}
	}
}
