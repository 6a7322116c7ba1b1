package sharedtransport_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log"
	"net/http"
	"net/url"
	"os"
	"path/filepath"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// startServer starts a local API server that requires client certificates
// and writes a kubeconfig for alice, with her certificate in files.
func startServer() (srv *testserver.Server, kubeconfig string, cleanup func()) {
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		log.Fatal(err)
	}
	alice, err := srv.CA().IssueClient("alice")
	if err != nil {
		log.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "sharedtransport-example")
	if err != nil {
		log.Fatal(err)
	}
	paths, err := srv.WriteKubeconfig(filepath.Join(dir, "kubeconfig"), alice, false)
	if err != nil {
		log.Fatal(err)
	}
	return srv, paths.Kubeconfig, func() { srv.Close(); os.RemoveAll(dir) }
}

// A config and a clientset per request, as a CLI in a loop or an aggregated
// apiserver proxying to member clusters builds them, with a Proxy function:
// client-go alone opens a connection per request; with the pool, one.
func Example() {
	srv, kubeconfig, cleanup := startServer()
	defer cleanup()

	pool := sharedtransport.New()
	defer pool.Close()
	for range 20 {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			log.Fatal(err)
		}
		cfg.Proxy = func(*http.Request) (*url.URL, error) { return nil, nil }
		httpClient, err := pool.HTTPClientFor(cfg) // instead of client-go's own
		if err != nil {
			log.Fatal(err)
		}
		clientset, err := kubernetes.NewForConfigAndClient(cfg, httpClient)
		if err != nil {
			log.Fatal(err)
		}
		if _, err := clientset.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
			log.Fatal(err)
		}
	}
	st := pool.Stats()
	fmt.Printf("requests: 20, connections the server accepted: %d\n", srv.Stats().Accepted)
	fmt.Printf("identities: %d, transports built: %d\n", st.Identities, st.Misses)
	// Output:
	// requests: 20, connections the server accepted: 1
	// identities: 1, transports built: 1
}

// Keep-alive off, as Karmada's proxy runs today: a connection per request,
// but TLS session resumption spares most full handshakes.
func ExampleWithKeepAlive() {
	srv, kubeconfig, cleanup := startServer()
	defer cleanup()

	pool := sharedtransport.New(sharedtransport.WithKeepAlive(false))
	defer pool.Close()
	for range 10 {
		cfg, err := pool.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			log.Fatal(err)
		}
		clientset, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			log.Fatal(err)
		}
		if _, err := clientset.CoreV1().Namespaces().List(context.Background(), metav1.ListOptions{}); err != nil {
			log.Fatal(err)
		}
	}
	st := srv.Stats()
	fmt.Printf("connections: %d, full handshakes: %d, resumed: %d\n", st.Accepted, st.FullHandshakes, st.ResumedHandshakes)
	// Output:
	// connections: 10, full handshakes: 1, resumed: 9
}

// kubectl plugins and karmadactl build configs through cli-runtime's
// ConfigFlags, whose WrapConfigFn has this shape.
func ExamplePool_WrapConfigFn() {
	srv, kubeconfig, cleanup := startServer()
	defer cleanup()

	pool := sharedtransport.New()
	defer pool.Close()
	var wrapConfig = pool.WrapConfigFn // configFlags.WrapConfigFn = pool.WrapConfigFn

	loader := &clientcmd.ClientConfigLoadingRules{ExplicitPath: kubeconfig}
	for range 5 {
		cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(loader, nil).ClientConfig()
		if err != nil {
			log.Fatal(err)
		}
		clientset, err := kubernetes.NewForConfig(wrapConfig(cfg))
		if err != nil {
			log.Fatal(err)
		}
		if _, err := clientset.Discovery().ServerVersion(); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Printf("connections: %d, wrap errors: %d\n", srv.Stats().Accepted, pool.Stats().WrapErrors)
	// Output:
	// connections: 1, wrap errors: 0
}

// A cluster proxy that builds a TLS configuration per request from a
// member's CA bundle, as Karmada's does, and hands it to the pool instead of
// building an *http.Transport: equal settings share one connection, and the
// per-request credentials (here a bearer token) ride above it.
func ExamplePool_TLSTransport() {
	srv, err := testserver.Start(testserver.Options{
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{"front-token": "karmada-front"},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close()

	pool := sharedtransport.New()
	defer pool.Close()
	for range 20 {
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(srv.CA().CertPEM()) // the member's caBundle
		rt, err := pool.TLSTransport(sharedtransport.TLSTransportConfig{
			TLS: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		})
		if err != nil {
			log.Fatal(err)
		}
		req, err := http.NewRequest(http.MethodGet, srv.URL()+"/api/v1/nodes", nil)
		if err != nil {
			log.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer front-token")
		resp, err := rt.RoundTrip(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			log.Fatal(resp.Status)
		}
	}
	fmt.Printf("requests: 20, connections the server accepted: %d\n", srv.Stats().Accepted)
	// Output:
	// requests: 20, connections the server accepted: 1
}
