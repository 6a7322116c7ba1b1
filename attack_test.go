package sharedtransport

// Second adversarial review of the copy-safety rule (branch rv-attack): each
// test makes a client of a copy, or a TransportFor round tripper, that the
// server or the proxies see otherwise than the same config through client-go
// alone.

import (
	"crypto/tls"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"

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

// TestAdversaryInnerWrapperOwnCertificate: a copy prepends a wrapper (inside
// the hook) that hands client-go's transport a GetClientCertificate of its
// own: alice's certificate now, bob's later. The hook asks it once, finds
// alice's bytes, and remembers the match for the generation (an inline
// identity has one for good): after the wrapper's function hands out bob,
// client-go alone presents bob and the pool must not present alice.
func TestAdversaryInnerWrapperOwnCertificate(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	alice, err := f.alice.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	bob, err := f.bob.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	var current atomic.Pointer[tls.Certificate]
	current.Store(&alice)
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	cp := pair.copies(func(c *rest.Config) {
		c.CertData, c.KeyData = nil, nil
		c.WrapTransport = transport.Wrappers(func(rt http.RoundTripper) http.RoundTripper {
			// client-go v0.36+ hands wrappers its transport inside holders.
			t := httpTransport(rt)
			if t == nil {
				return rt
			}
			t = t.Clone()
			t.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return current.Load(), nil }
			return t
		}, c.WrapTransport)
	})
	before := [2]*rigClient{r.client(cp.wrapped), r.client(cp.control)}
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	for i, c := range before {
		if o := c.observe(); o != aliceSeen {
			t.Fatalf("client %d before the wrapper's change: %+v, want %+v", i, o, aliceSeen)
		}
	}
	current.Store(&bob)
	// The clone's HTTP/2 connections live in the pool of the transport it
	// was cloned from, which closing the clone's idle connections does not
	// reach: the server closes them, so every client handshakes again.
	r.srv.CloseClientConnections()
	got, control := before[0].observe(), before[1].observe()
	if got != control {
		t.Errorf("client of the copy built before the change: through the pool %+v, through client-go alone %+v", got, control)
	}
	if bobSeen := (observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}); control != bobSeen {
		t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", control, bobSeen)
	}
}

// TestAdversaryOuterWrapperUnwraps: a wrapper added after Wrap (above the
// hook) that finds the *http.Transport below it the way client-go's own
// helpers do (through utilnet.RoundTripperWrapper), clones it and sends the
// clone through another proxy. Above the hook it finds the pool's shared
// transport, and its clone keeps what the pool's generation presented when
// the client was built.
func TestAdversaryOuterWrapperUnwraps(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	proxy2 := proxyTo(r.proxies[1])
	unwrapAndProxy := func(rt http.RoundTripper) http.RoundTripper {
		inner := rt
		for range 8 {
			if t, ok := inner.(*http.Transport); ok {
				t = t.Clone()
				t.Proxy = proxy2
				return t
			}
			w, ok := inner.(utilnet.RoundTripperWrapper)
			if !ok {
				break
			}
			inner = w.WrappedRoundTripper()
		}
		return rt
	}
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair := wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
	cp := pair.copies(func(c *rest.Config) { c.Wrap(unwrapAndProxy) })
	before := [2]*rigClient{r.client(cp.wrapped), r.client(cp.control)}
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 2"}
	for i, c := range before {
		if o := c.observe(); o != aliceSeen {
			t.Errorf("client %d before rotation: %+v, want %+v", i, o, aliceSeen)
		}
	}
	d.write(t, f.bob, f.ca.CertPEM())
	waitFor(t, "rotation to bob", func() bool { return p.Stats().Rotations == 1 })
	time.Sleep(certFileSettle + 500*time.Millisecond)
	bobSeen := observation{CN: "bob", Proto: h2, Gzip: true, Via: "proxy 2"}
	got, control := before[0].observe(), before[1].observe()
	if got != control {
		t.Errorf("client built before rotation: through the pool %+v, through client-go alone %+v", got, control)
	}
	if control != bobSeen {
		t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", control, bobSeen)
	}
	r.check(t, cp, &bobSeen)
}
