package sharedtransport_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/util/proxy"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// memberSecret is what the Secret of a member cluster holds: the CA of its
// API server and the front's credentials there.
type memberSecret struct {
	caData, certData, keyData []byte
	token                     string
	proxyURL                  string // optional HTTP proxy in front of the member
}

// clusters is the front's view of its member clusters, an informer's cache in
// Karmada: API endpoint and Secret by cluster name.
type clusters struct {
	mu       sync.RWMutex
	endpoint map[string]string
	secret   map[string]memberSecret
}

func (c *clusters) set(name, endpoint string, s memberSecret) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endpoint[name], c.secret[name] = endpoint, s
}

func (c *clusters) get(name string) (string, memberSecret, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	e, ok := c.endpoint[name]
	return e, c.secret[name], ok
}

// memberConfig builds a member's rest.Config from its Secret. The front does
// it for every request, so a rotated Secret is used at once.
func memberConfig(endpoint string, s memberSecret) (*rest.Config, error) {
	cfg := &rest.Config{
		Host:            endpoint,
		TLSClientConfig: rest.TLSClientConfig{CAData: s.caData, CertData: s.certData, KeyData: s.keyData},
		BearerToken:     s.token,
	}
	if s.proxyURL != "" {
		u, err := url.Parse(s.proxyURL)
		if err != nil {
			return nil, err
		}
		cfg.Proxy = http.ProxyURL(u)
	}
	return cfg, nil
}

// memberProxy is the front: /clusters/{name}/proxy/{path...} goes to that
// member cluster, through a config built from its Secret. pool.TransportFor in
// place of rest.TransportFor is the one line the pool changes: every config of
// one identity (CA, client certificate, proxy) then shares one transport,
// whatever token the request carries, and client-go builds no transport per
// request.
func memberProxy(pool *sharedtransport.Pool, members *clusters) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/clusters/{name}/proxy/{path...}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		endpoint, secret, ok := members.get(name)
		if !ok {
			http.Error(w, fmt.Sprintf("cluster %q not found", name), http.StatusNotFound)
			return
		}
		cfg, err := memberConfig(endpoint, secret)
		var rt http.RoundTripper
		if err == nil {
			rt, err = pool.TransportFor(cfg)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		location, err := url.Parse(endpoint + "/" + r.PathValue("path"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		location.RawQuery = r.URL.RawQuery
		// The member must see the front's credentials only.
		r.Header.Del("Authorization")

		h := proxy.NewUpgradeAwareHandler(location, rt, false, false, unreachable(name))
		h.UseLocationHost = true
		if httpstream.IsUpgradeRequest(r) {
			// exec, attach, port-forward: one HTTP/1.1 connection of their
			// own, never a pooled one, with the credentials client-go's
			// wrappers add.
			tlsConfig, err := rest.TLSConfigFor(cfg)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			headers, err := rest.HTTPWrappersForConfig(cfg, proxy.MirrorRequest)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			h.UpgradeTransport = proxy.NewUpgradeRequestRoundTripper(&http.Transport{TLSClientConfig: tlsConfig}, headers)
		}
		h.ServeHTTP(w, r)
	})
	return mux
}

// unreachable answers a request the member could not be reached for.
type unreachable string

func (name unreachable) Error(w http.ResponseWriter, _ *http.Request, err error) {
	http.Error(w, fmt.Sprintf("cluster %q is unreachable: %v", string(name), err), http.StatusServiceUnavailable)
}

// The pattern an aggregated apiserver such as Karmada's would adopt: a config
// per request, built from the member's Secret, and its round tripper from one
// pool. Members count the connections they accept.
func Example_memberClusterProxy() {
	ca1, _ := testserver.NewCA("member-1-ca")
	member1, _ := testserver.Start(testserver.Options{CA: ca1})
	defer member1.Close()
	member2, _ := testserver.Start(testserver.Options{
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{"member-2-token": "karmada-front-by-token"},
	})
	defer member2.Close()

	byCert, _ := ca1.IssueClient("karmada-front")
	members := &clusters{endpoint: map[string]string{}, secret: map[string]memberSecret{}}
	members.set("member-1", member1.URL(), memberSecret{caData: ca1.CertPEM(), certData: byCert.CertPEM, keyData: byCert.KeyPEM})
	members.set("member-2", member2.URL(), memberSecret{caData: member2.CA().CertPEM(), token: "member-2-token"})

	pool := sharedtransport.New()
	defer pool.Close()
	front := httptest.NewServer(memberProxy(pool, members))
	defer front.Close()
	defer front.Client().CloseIdleConnections()

	whoAmI := func(cluster string) string {
		review := `{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`
		resp, err := front.Client().Post(front.URL+"/clusters/"+cluster+"/proxy/apis/authentication.k8s.io/v1/selfsubjectreviews",
			"application/json", strings.NewReader(review))
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		var out struct {
			Status struct {
				UserInfo struct{ Username string }
			}
		}
		body, _ := io.ReadAll(resp.Body)
		if err := json.NewDecoder(bytes.NewReader(body)).Decode(&out); err != nil {
			return resp.Status + " " + string(body)
		}
		return out.Status.UserInfo.Username
	}
	// A first request to each member opens its connection; 50 more to each,
	// all at once, share it.
	for _, cluster := range []string{"member-1", "member-2"} {
		fmt.Printf("%s sees the front as %s\n", cluster, whoAmI(cluster))
	}
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cluster := []string{"member-1", "member-2"}[i%2]
			resp, err := front.Client().Get(front.URL + "/clusters/" + cluster + "/proxy/api/v1/nodes")
			if err != nil {
				fmt.Println(err)
				return
			}
			defer resp.Body.Close()
			if _, err := io.Copy(io.Discard, resp.Body); err != nil || resp.StatusCode != http.StatusOK {
				fmt.Println(cluster, resp.Status, err)
			}
		}()
	}
	wg.Wait()
	for _, m := range []struct {
		name string
		srv  *testserver.Server
	}{{"member-1", member1}, {"member-2", member2}} {
		fmt.Printf("%s accepted %d connection(s) for 51 requests\n", m.name, m.srv.Stats().Accepted)
	}

	// The Secret of member-1 is rotated: the next request authenticates with
	// the new certificate, on a new connection.
	rotated, _ := ca1.IssueClient("karmada-front-rotated")
	members.set("member-1", member1.URL(), memberSecret{caData: ca1.CertPEM(), certData: rotated.CertPEM, keyData: rotated.KeyPEM})
	fmt.Printf("after the rotation member-1 sees the front as %s; connections: %d\n", whoAmI("member-1"), member1.Stats().Accepted)

	// Output:
	// member-1 sees the front as karmada-front
	// member-2 sees the front as karmada-front-by-token
	// member-1 accepted 1 connection(s) for 51 requests
	// member-2 accepted 1 connection(s) for 51 requests
	// after the rotation member-1 sees the front as karmada-front-rotated; connections: 2
}
