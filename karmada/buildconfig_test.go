package karmada

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	clusterv1alpha1 "github.com/karmada-io/karmada/pkg/apis/cluster/v1alpha1"
	"github.com/karmada-io/karmada/pkg/util"
	"github.com/karmada-io/karmada/pkg/util/proxy"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
)

// controllerMembers are member clusters as Karmada's controllers read them
// (v1alpha1), all at the e2e kube-apiserver behind one proxy, each with its
// own ProxyHeader.
type controllerMembers map[string]*clusterv1alpha1.Cluster

func (m controllerMembers) cluster(name string) (*clusterv1alpha1.Cluster, error) {
	if c, ok := m[name]; ok {
		return c.DeepCopy(), nil
	}
	return nil, fmt.Errorf("cluster %s not found", name)
}

func (m controllerMembers) secret(string, string) (*corev1.Secret, error) {
	return &corev1.Secret{Data: m.secretData()}, nil
}

// secretData is what every member's Secret holds: the impersonator token
// and the kube-apiserver's CA.
func (controllerMembers) secretData() map[string][]byte {
	return map[string][]byte{clusterv1alpha1.SecretTokenKey: []byte(token), clusterv1alpha1.SecretCADataKey: kube.ServingCA.CertPEM()}
}

// newControllerMembers returns members named by their proxy credentials,
// behind a proxy that takes each of them.
func newControllerMembers(t *testing.T, creds ...string) (controllerMembers, *connectproxy.Proxy) {
	proxy, err := connectproxy.Start(connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: creds})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	m := controllerMembers{}
	for _, c := range creds {
		m[c] = &clusterv1alpha1.Cluster{
			ObjectMeta: metav1.ObjectMeta{Name: c},
			Spec: clusterv1alpha1.ClusterSpec{
				APIEndpoint: kube.URL,
				SecretRef:   &clusterv1alpha1.LocalSecretReference{Namespace: secretNamespace, Name: c},
				ProxyURL:    proxy.URL(),
				ProxyHeader: map[string]string{"Proxy-Authorization": c},
			},
		}
	}
	return m, proxy
}

// How a reconcile hands its config to the pool.
type wrapMode int

const (
	clientGoAlone  wrapMode = iota // no pool
	wrapUndeclared                 // pool.Wrap: Karmada's ProxyHeader wrapper is not declared
	clientDeclared                 // pool.HTTPClientFor with the cluster's ProxyHeader: the patched client sets
)

// reconcile is what a controller does per reconcile: a config from
// BuildClusterConfig, handed to pool as mode says, a clientset, a request.
func reconcile(ctx context.Context, m controllerMembers, name string, pool *sharedtransport.Pool, mode wrapMode) error {
	cfg, err := util.BuildClusterConfig(name, m.cluster, m.secret)
	if err != nil {
		return err
	}
	var cs *kubernetes.Clientset
	switch mode {
	case clientGoAlone:
		cs, err = kubernetes.NewForConfig(rest.CopyConfig(cfg))
	case wrapUndeclared:
		if err = pool.Wrap(cfg); err == nil {
			cs, err = kubernetes.NewForConfig(rest.CopyConfig(cfg))
		}
	case clientDeclared:
		// The lines a cluster client set gains in Karmada (there with its
		// own parseProxyHeaders, which also canonicalises the keys): the
		// config has a Proxy, so its client comes from HTTPClientFor.
		cl, _ := m.cluster(name)
		var hc *http.Client
		hc, err = pool.HTTPClientFor(cfg, sharedtransport.WithProxyConnectHeader(proxy.ParseProxyHeaders(cl.Spec.ProxyHeader)))
		if err == nil {
			cs, err = kubernetes.NewForConfigAndClient(cfg, hc)
		}
	}
	if err != nil {
		return err
	}
	ssr, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	if got, want := ssr.Status.UserInfo.Username, "system:serviceaccount:"+saNamespace+":"+saName; got != want {
		return fmt.Errorf("the member saw %q, want %q", got, want)
	}
	return nil
}

// TestBuildClusterConfigProxyHeader: Karmada's BuildClusterConfig with
// Spec.ProxyHeader. Clients from HTTPClientFor with the header
// declared: one tunnel per member and header for many reconciles, none
// refused, each tunnel with its member's header. Wrap passes the config
// through (it has a Proxy, and Karmada's wrapper is not declared): what
// client-go alone does, a tunnel per reconcile, none refused.
func TestBuildClusterConfigProxyHeader(t *testing.T) {
	const reconciles = 50
	ctx := context.Background()
	creds := []string{"Basic bWVtYmVyLWE=", "Basic bWVtYmVyLWI="}
	t.Run("pool, declared", func(t *testing.T) {
		m, proxy := newControllerMembers(t, creds...)
		pool := sharedtransport.New()
		defer pool.Close()
		for i := range 2 * reconciles {
			for _, c := range creds {
				if err := reconcile(ctx, m, c, pool, clientDeclared); err != nil {
					t.Fatalf("reconcile %d of %s: %v", i, c, err)
				}
			}
		}
		st := proxy.Stats()
		if st.Tunnels != 2 || st.Rejected != 0 {
			t.Errorf("%d reconciles of each of 2 members: %d tunnels, %d refused; want 2 and 0", 2*reconciles, st.Tunnels, st.Rejected)
		}
		seen := map[string]int{}
		for _, tn := range proxy.Tunnels() {
			seen[tn.Header.Get("Proxy-Authorization")]++
		}
		for _, c := range creds {
			if seen[c] != 1 {
				t.Errorf("tunnels by header %v, want one for each member", seen)
			}
		}
		t.Logf("BuildClusterConfig + ProxyHeader, HTTPClientFor: %d reconciles of each of 2 members, %d tunnels, %d refused (407)", 2*reconciles, st.Tunnels, st.Rejected)
	})
	for _, mode := range []wrapMode{wrapUndeclared, clientGoAlone} {
		name := map[wrapMode]string{wrapUndeclared: "pool, undeclared: passes through", clientGoAlone: "client-go alone"}[mode]
		t.Run(name, func(t *testing.T) {
			m, proxy := newControllerMembers(t, creds[0])
			pool := sharedtransport.New()
			defer pool.Close()
			for i := range reconciles {
				if err := reconcile(ctx, m, creds[0], pool, mode); err != nil {
					t.Fatalf("reconcile %d: %v", i, err)
				}
			}
			st := proxy.Stats()
			if st.Tunnels != reconciles || st.Rejected != 0 {
				t.Errorf("%d tunnels, %d refused for %d reconciles; want one each and 0", st.Tunnels, st.Rejected, reconciles)
			}
			if ps := pool.Stats(); mode == wrapUndeclared && (ps.PassThrough != reconciles || ps.Identities != 0) {
				t.Errorf("pool %+v, want every config passed through", ps)
			}
			t.Logf("BuildClusterConfig + ProxyHeader, %s: %d reconciles, %d tunnels, %d refused (407)", name, reconciles, st.Tunnels, st.Rejected)
		})
	}
}
