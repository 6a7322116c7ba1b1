// CAPO's own scopes against a fake Keystone and Nova: capo/hack/test-capo.sh
// copies this file into CAPO's pkg/scope, as is and patched (build tag
// capo_patched), with the API version its provider.go imports.

package scope_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/gophercloud/gophercloud/v2"
	"github.com/gophercloud/gophercloud/v2/openstack"
	"github.com/gophercloud/gophercloud/v2/openstack/compute/v2/servers"
	"github.com/gophercloud/gophercloud/v2/pagination"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	infrav1 "sigs.k8s.io/cluster-api-provider-openstack/api/v1beta2"
	"sigs.k8s.io/cluster-api-provider-openstack/pkg/scope"

	"github.com/sharedtransport/sharedtransport/capo/fakeopenstack"
)

// credentialed is one cluster's identity reference, as an OpenStackCluster
// gives it.
type credentialed struct {
	namespace string
	ref       infrav1.OpenStackIdentityReference
}

func (c credentialed) GetIdentityRef() (*string, *infrav1.OpenStackIdentityReference) {
	return &c.namespace, &c.ref
}

// cloudsYAML is a clouds.yaml for user against the cloud at url, CAPO's
// credential Secret.
func cloudsYAML(url, user string) []byte {
	return fmt.Appendf(nil, `clouds:
  openstack:
    auth:
      auth_url: %s/v3
      username: %s
      password: %s-pass
      project_name: project-%s
      user_domain_name: Default
      project_domain_name: Default
    region_name: %s
    interface: public
    identity_api_version: 3
`, url, user, user, user, fakeopenstack.Region)
}

// passwords are n users' passwords, by user: user0, user1, ...
func passwords(n int) map[string]string {
	users := map[string]string{}
	for i := range n {
		users[fmt.Sprintf("user%d", i)] = fmt.Sprintf("user%d-pass", i)
	}
	return users
}

// credentials are the credential Secrets of n users of the cloud at url
// (trusting ca) in a fake controller-runtime client, and the identity
// references of n clusters, the i-th using user i's.
func credentials(url string, ca []byte, n int) (client.Client, []credentialed) {
	var objs []runtime.Object
	var refs []credentialed
	for i := range n {
		user := fmt.Sprintf("user%d", i)
		objs = append(objs, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: "clusters", Name: "cred-" + user},
			Data:       map[string][]byte{scope.CloudsSecretKey: cloudsYAML(url, user), scope.CASecretKey: ca},
		})
		refs = append(refs, credentialed{namespace: "clusters", ref: infrav1.OpenStackIdentityReference{Name: "cred-" + user, CloudName: "openstack"}})
	}
	return fake.NewClientBuilder().WithRuntimeObjects(objs...).Build(), refs
}

// TestSharedScopeConnections: clusters with a credential each, every
// reconcile building its scope (no scope cache, CAPO's worst case), list
// their servers through CAPO's own compute client, against a server with
// HTTP/2 and one with HTTP/1.1 only. Each request is served with its own
// credential's token. As is, each scope dials its own connection and keeps
// it open (CAPO issue 3227); patched, the scopes share connections, at most
// twice as many as net/http's best case: one transport built CAPO's way for
// every scope, the same load against a server of its own.
func TestSharedScopeConnections(t *testing.T) {
	for _, http1 := range []bool{false, true} {
		t.Run(fmt.Sprintf("HTTP/1.1 only %v", http1), func(t *testing.T) { sharedScopeConnections(t, http1) })
	}
}

func sharedScopeConnections(t *testing.T, http1 bool) {
	const clusters, workers, reconciles = 10, 10, 5
	users := passwords(clusters)
	s, err := fakeopenstack.Start(fakeopenstack.Options{HTTP1Only: http1, Users: users})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, refs := credentials(s.URL, s.CA, clusters)
	factory := scope.NewFactory(0)

	var wg sync.WaitGroup
	errs := make(chan error, workers*reconciles)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range reconciles {
				i := (w + r) % clusters
				errs <- reconcile(factory, c, refs[i], fmt.Sprintf("server-of-user%d", i))
			}
		}()
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if err != nil {
			failed++
			t.Error(err)
		}
	}
	got := s.Counts()
	t.Logf("patched %v: %d reconciles (%d failed); the server: %+v", patched, workers*reconciles, failed, got)
	if got.WrongTokens != 0 {
		t.Errorf("%d requests came with a token that was not theirs or had expired", got.WrongTokens)
	}
	best := sharedTransportLoad(t, http1, users, workers, reconciles)
	t.Logf("net/http's best case, one transport for every scope: %+v", best)
	if patched && got.Accepted > 2*best.Accepted {
		t.Errorf("patched: the server accepted %d connections for %d reconciles, net/http's best case %d; want at most twice that", got.Accepted, workers*reconciles, best.Accepted)
	}
	if !patched && (got.Accepted < workers*reconciles || got.Open < workers*reconciles) {
		t.Errorf("as is: the server accepted %d connections for %d reconciles and %d are open, want one per scope, left open", got.Accepted, workers*reconciles, got.Open)
	}
}

// sharedTransportLoad runs the load without CAPO's scopes: gophercloud
// clients that authenticate and list as a scope does, every one through one
// *http.Transport built as CAPO builds its own; it returns what the server
// counted.
func sharedTransportLoad(t *testing.T, http1 bool, users map[string]string, workers, reconciles int) fakeopenstack.Counts {
	s, err := fakeopenstack.Start(fakeopenstack.Options{HTTP1Only: http1, Users: users})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(s.CA)
	shared := &http.Transport{Proxy: http.ProxyFromEnvironment, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots}}
	defer shared.CloseIdleConnections()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range reconciles {
				user := fmt.Sprintf("user%d", (w+r)%len(users))
				err := listThrough(shared, s.URL, user, users[user])
				if err != nil {
					t.Errorf("net/http's best case, %s: %v", user, err)
				}
			}
		}()
	}
	wg.Wait()
	return s.Counts()
}

// listThrough authenticates user and lists its servers through rt, without
// CAPO's scopes: what a scope does, gophercloud's calls in CAPO's order.
func listThrough(rt http.RoundTripper, url, user, password string) error {
	provider, err := openstack.NewClient(url + "/v3")
	if err == nil {
		provider.HTTPClient.Transport = rt
		err = openstack.Authenticate(context.Background(), provider, gophercloud.AuthOptions{
			IdentityEndpoint: url + "/v3", Username: user, Password: password, DomainName: "Default",
			TenantName: "project-" + user, AllowReauth: true,
		})
	}
	var compute *gophercloud.ServiceClient
	if err == nil {
		compute, err = openstack.NewComputeV2(provider, gophercloud.EndpointOpts{Region: fakeopenstack.Region})
	}
	if err == nil {
		_, err = compute.Request(context.Background(), "GET", compute.Endpoint, &gophercloud.RequestOpts{OkCodes: []int{200}})
	}
	if err == nil {
		var pages pagination.Page
		if pages, err = servers.List(compute, servers.ListOpts{}).AllPages(context.Background()); err == nil {
			var list []servers.Server
			if list, err = servers.ExtractServers(pages); err == nil && (len(list) != 1 || list[0].Name != "server-of-"+user) {
				err = fmt.Errorf("servers of %s: %+v: a token of another user", user, list)
			}
		}
	}
	return err
}

// reconcile builds a scope for ref, as a reconcile does, and lists its
// servers with CAPO's compute client; the server names whose token it took.
// The scope logs through klog, as CAPO's manager's do.
func reconcile(factory scope.Factory, c client.Client, ref credentialed, want string) error {
	sc, err := factory.NewClientScopeFromObject(context.Background(), c, nil, klog.Background(), ref)
	if err != nil {
		return fmt.Errorf("scope for %s: %w", ref.ref.Name, err)
	}
	compute, err := sc.NewComputeClient()
	if err != nil {
		return fmt.Errorf("compute client for %s: %w", ref.ref.Name, err)
	}
	list, err := compute.ListServers(servers.ListOpts{})
	if err != nil {
		return fmt.Errorf("servers of %s: %w", ref.ref.Name, err)
	}
	if len(list) != 1 || list[0].Name != want {
		return fmt.Errorf("servers of %s: %+v, want %s: a token of another credential", ref.ref.Name, list, want)
	}
	return nil
}
