package sharedtransport

// Second adversarial review of the copy-safety rule (branch rv-attack): each
// test makes a client of a copy, or a TransportFor round tripper, that the
// server or the proxies see otherwise than the same config through client-go
// alone.

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestAdversaryCopyExecOverInline: the original holds alice's certificate
// inline; a copy drops it for an exec plugin that prints alice's certificate
// too, for now. The copy's transport presents alice's bytes when the hook
// compares, so it rides the shared transport; once the plugin hands out
// bob's certificate, client-go alone presents bob (its exec authenticator
// closes its connections), and the pool must not keep presenting alice.
func TestAdversaryCopyExecOverInline(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	exec := writeExecPlugin(t, f.dir, "atk-inline", f.alice)
	expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
	writeExecCredential(t, f.dir, "atk-inline", f.alice, expiry)
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	cp := pair.copies(func(c *rest.Config) {
		c.CertData, c.KeyData = nil, nil
		e := *exec
		c.ExecProvider = &e
	})
	before := [2]*rigClient{r.client(cp.wrapped), r.client(cp.control)}
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	for i, c := range before {
		if o := c.observe(); o != aliceSeen {
			t.Fatalf("client %d before the plugin's change: %+v, want %+v", i, o, aliceSeen)
		}
	}
	writeExecCredential(t, f.dir, "atk-inline", f.bob, time.Time{})
	time.Sleep(time.Until(expiry) + 200*time.Millisecond)
	bobSeen := observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}
	for range 2 {
		got, control := before[0].observe(), before[1].observe()
		if got != control {
			t.Errorf("client of the copy built before the plugin's change: through the pool %+v, through client-go alone %+v", got, control)
		}
		if control != bobSeen {
			t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", control, bobSeen)
		}
	}
	r.check(t, cp, &bobSeen)
}

// TestAdversaryTransportForProxyPerPath: TestAdversaryProxyPerPath for
// TransportFor. http.Transport asks the config's Proxy for every request;
// TransportFor sends every request to the config's host over the shared
// transport, whose proxy is the answer the function gave for the probe
// request. A Proxy that sends some paths (or schemes) elsewhere is bypassed.
func TestAdversaryTransportForProxyPerPath(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	proxy := newConnectProxy(t)
	proxyURL, _ := url.Parse(proxy.url())
	for _, tc := range []struct {
		name  string
		proxy func(*http.Request) (*url.URL, error)
	}{
		{"nodes through the proxy, the rest direct", func(req *http.Request) (*url.URL, error) {
			if strings.HasSuffix(req.URL.Path, "/nodes") {
				return proxyURL, nil
			}
			return nil, nil
		}},
		{"nodes direct, the rest through the proxy", func(req *http.Request) (*url.URL, error) {
			if strings.HasSuffix(req.URL.Path, "/nodes") {
				return nil, nil
			}
			return proxyURL, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t)
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = tc.proxy
			vias := map[string][]string{}
			for name, newRT := range map[string]func(*rest.Config) (http.RoundTripper, error){"pool": p.TransportFor, "client-go": rest.TransportFor} {
				rt, err := newRT(rest.CopyConfig(cfg))
				if err != nil {
					t.Fatal(err)
				}
				for _, path := range []string{"/version", "/api/v1/nodes", "/version", "/api/v1/nodes"} {
					// A new connection each time: HTTP/2 reuses a connection
					// to the host whatever the proxy says.
					utilnet.CloseIdleConnectionsFor(rt)
					if code, err := getVia(rt, f.srv.URL()+path); err != nil || code >= 500 {
						t.Fatalf("%s %s: %d %v", name, path, code, err)
					}
					ri, ok := f.srv.LastRequest(path)
					if !ok {
						t.Fatalf("%s %s: the server saw no request", name, path)
					}
					via := "direct"
					if _, ok := proxy.Carried(ri.RemoteAddr, f.srv.Addr()); ok {
						via = "proxy"
					}
					vias[name] = append(vias[name], path+" "+via)
				}
			}
			if strings.Join(vias["pool"], ", ") != strings.Join(vias["client-go"], ", ") {
				t.Errorf("through the pool: %v; through client-go alone: %v", vias["pool"], vias["client-go"])
			}
		})
	}
}
