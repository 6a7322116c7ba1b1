package sharedtransport

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"runtime"
	"strings"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// tlsRig is a member server behind a CONNECT proxy that requires one of two
// headers, and the settings a hand-built transport to it carries.
type tlsRig struct {
	srv   *testserver.Server
	proxy *connectProxy
	caPEM []byte
}

func newTLSRig(t *testing.T, opts testserver.Options) *tlsRig {
	t.Helper()
	ca, err := testserver.NewCA("tlstransport-ca")
	must(t, err)
	opts.CA = ca
	opts.ClientAuth = testserver.VerifyClientCertIfGiven
	opts.Tokens = map[string]string{"token-x": "x"}
	srv, err := testserver.Start(opts)
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	return &tlsRig{srv: srv, proxy: newAuthProxy(t, "Basic a", "Basic b"), caPEM: ca.CertPEM()}
}

// settings are what Karmada's proxy sets for one request: roots parsed
// anew from the bundle, TLS 1.3 at least, the proxy and its header.
func (r *tlsRig) settings(bundle []byte, cred string) TLSTransportConfig {
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(bundle)
	u, _ := url.Parse(r.proxy.url())
	return TLSTransportConfig{
		TLS:                &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS13},
		Proxy:              u,
		ProxyConnectHeader: http.Header{"Proxy-Authorization": {cred}},
	}
}

// get sends one request over a TLSTransport of c and returns its error.
func (r *tlsRig) get(p *Pool, c TLSTransportConfig) error {
	rt, err := p.TLSTransport(c)
	if err != nil {
		return err
	}
	req, _ := http.NewRequest(http.MethodGet, r.srv.URL()+"/version", nil)
	req.Header.Set("Authorization", "Bearer token-x")
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}

func TestTLSTransport(t *testing.T) {
	t.Run("calls with equal settings share one tunnel; another header is another", func(t *testing.T) {
		r := newTLSRig(t, testserver.Options{})
		p := newPool(t)
		for i := range 20 {
			if err := r.get(p, r.settings(r.caPEM, "Basic a")); err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
		}
		wantTunnels(t, r.proxy, 1, "20 calls of one cluster")
		must(t, r.get(p, r.settings(r.caPEM, "Basic b")))
		wantTunnels(t, r.proxy, 2, "two headers")
		if st := p.Stats(); st.Identities != 2 {
			t.Errorf("%d identities, want 2", st.Identities)
		}
		if n := r.srv.Stats().Accepted; n != 2 {
			t.Errorf("the server accepted %d connections, want 2", n)
		}
	})
	t.Run("MinVersion is kept: a TLS 1.2 server is refused", func(t *testing.T) {
		r := newTLSRig(t, testserver.Options{MaxTLSVersion: tls.VersionTLS12})
		err := r.get(newPool(t), r.settings(r.caPEM, "Basic a"))
		if err == nil || !strings.Contains(err.Error(), "protocol version") {
			t.Errorf("got %v, want a refused handshake", err)
		}
	})
	t.Run("a new caBundle takes effect on the next call; the old identity is released", func(t *testing.T) {
		r := newTLSRig(t, testserver.Options{})
		other, err := testserver.NewCA("other-ca")
		must(t, err)
		p := newPool(t, WithIdleTimeout(10*time.Millisecond))
		must(t, r.get(p, r.settings(r.caPEM, "Basic a")))
		if err := r.get(p, r.settings(other.CertPEM(), "Basic a")); err == nil || !strings.Contains(err.Error(), "unknown authority") {
			t.Fatalf("with a bundle that does not hold the server's CA: %v, want unknown authority", err)
		}
		both := append(other.CertPEM(), r.caPEM...)
		must(t, r.get(p, r.settings(both, "Basic a")))
		if n := r.proxy.Stats().Tunnels; n != 3 {
			t.Errorf("%d tunnels for three bundles, want 3", n)
		}
		for i := 0; p.Stats().Identities != 0; i++ {
			if i == 500 {
				t.Fatalf("%d identities left with no round tripper of them, want 0", p.Stats().Identities)
			}
			runtime.GC()
			time.Sleep(10 * time.Millisecond)
		}
	})
	t.Run("settings the pool cannot compare are refused", func(t *testing.T) {
		r := newTLSRig(t, testserver.Options{})
		for name, change := range map[string]func(*tls.Config){
			"Certificates": func(c *tls.Config) { c.Certificates = []tls.Certificate{{}} },
			"VerifyPeerCertificate": func(c *tls.Config) {
				c.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error { return nil }
			},
		} {
			c := r.settings(r.caPEM, "Basic a")
			change(c.TLS)
			if _, err := newPool(t).TLSTransport(c); err == nil || !strings.Contains(err.Error(), name) {
				t.Errorf("%s: got %v, want an error naming it", name, err)
			}
		}
	})
}

// TestTLSTransportKeepsItsCopy: what decides a TLSTransport identity is
// copied at the call and kept apart by value. Configurations that differ
// only in their TLS versions are two identities; a caller that reuses its
// NextProtos slice or adds to its pool after the call changes nothing the
// pool sends.
func TestTLSTransportKeepsItsCopy(t *testing.T) {
	r := newTLSRig(t, testserver.Options{})
	p := newPool(t)
	c := r.settings(r.caPEM, "Basic a")
	must(t, r.get(p, c))
	c12 := r.settings(r.caPEM, "Basic a")
	c12.TLS.MinVersion = tls.VersionTLS12
	must(t, r.get(p, c12))
	if n := p.Stats().Identities; n != 2 {
		t.Errorf("TLS 1.3 and TLS 1.2 minimums: %d identities, want 2", n)
	}

	np := []string{"h2", "http/1.1"}
	c2 := r.settings(r.caPEM, "Basic b")
	c2.TLS.NextProtos = np
	must(t, r.get(p, c2))
	np[0] = "not-h2"
	other, err := testserver.NewCA("other-ca")
	must(t, err)
	c2.TLS.RootCAs.AppendCertsFromPEM(other.CertPEM())
	c3 := r.settings(r.caPEM, "Basic b")
	c3.TLS.NextProtos = []string{"h2", "http/1.1"}
	rt, err := p.TLSTransport(c3)
	must(t, err)
	rt.(interface{ CloseIdleConnections() }).CloseIdleConnections() // a new handshake
	resp, err := (&http.Client{Transport: rt}).Get(r.srv.URL() + "/api")
	must(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.ProtoMajor != 2 || p.Stats().Identities != 3 {
		t.Errorf("after the first caller changed its slice and pool: %s over %d identities, want HTTP/2 over 3", resp.Proto, p.Stats().Identities)
	}
}

// TestTLSTransportInsecureWithRoots: RootCAs of a CA that did not sign the
// server, with InsecureSkipVerify, as Karmada's GetTLSConfigForCluster
// builds for a cluster with insecureSkipTLSVerification and a Secret: Go
// does not verify, so a plain transport of that configuration (the control)
// reaches the server, and so does the pool's. It is an identity of its own:
// a verifying configuration of the same roots fails on its own connection
// and never rides the unverified one.
func TestTLSTransportInsecureWithRoots(t *testing.T) {
	r := newTLSRig(t, testserver.Options{})
	other, err := testserver.NewCA("not-the-servers-ca")
	must(t, err)
	insecure := r.settings(other.CertPEM(), "Basic a")
	insecure.TLS.InsecureSkipVerify = true
	control := &http.Transport{TLSClientConfig: insecure.TLS.Clone(), Proxy: http.ProxyURL(insecure.Proxy), ProxyConnectHeader: insecure.ProxyConnectHeader}
	defer control.CloseIdleConnections()
	p := newPool(t)
	for name, rt := range map[string]func() (http.RoundTripper, error){
		"control: a transport of its own": func() (http.RoundTripper, error) { return control, nil },
		"pool":                            func() (http.RoundTripper, error) { return p.TLSTransport(insecure) },
	} {
		rt, err := rt()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		resp, err := (&http.Client{Transport: rt}).Get(r.srv.URL() + "/api")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if err := r.get(p, r.settings(other.CertPEM(), "Basic a")); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("the same roots, verified, after the insecure identity's request: %v, want unknown authority", err)
	}
	if n := p.Stats().Identities; n != 2 {
		t.Errorf("%d identities, want 2: the insecure one and the verifying one", n)
	}
}

// TestTLSTransportRootsForgotten: the numbers given to root pools are
// dropped once the identities holding them are gone.
func TestTLSTransportRootsForgotten(t *testing.T) {
	r := newTLSRig(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(time.Millisecond))
	count := func() int {
		p.roots.mu.Lock()
		defer p.roots.mu.Unlock()
		n := 0
		for _, rs := range p.roots.seen {
			n += len(rs)
		}
		return n
	}
	before := count()
	for range 20 {
		ca, err := testserver.NewCA("short-lived")
		must(t, err)
		if _, err := p.TLSTransport(r.settings(ca.CertPEM(), "Basic a")); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the pools' records dropped", func() bool {
		runtime.GC()
		return p.Stats().Identities == 0 && count() <= before
	})
}

// TestTLSTransportUnwrappedIsOwn: two callers of TLSTransport with equal
// settings; the first unwraps its round tripper and changes the
// *http.Transport it finds (a client certificate callback, a proxy): its
// requests go the changed way, and the second caller's are untouched, as
// with Go's own transports, one per caller (the control).
func TestTLSTransportUnwrappedIsOwn(t *testing.T) {
	f := newFixture(t, testserver.Options{ClientAuth: testserver.VerifyClientCertIfGiven})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	proxy := newConnectProxy(t)
	proxyURL, _ := url.Parse(proxy.url())
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(f.ca.CertPEM())
	settings := TLSTransportConfig{TLS: &tls.Config{RootCAs: roots}}
	changes := map[string]struct {
		change func(*http.Transport)
		want   string // what the first caller's next request shows
	}{
		"GetClientCertificate": {func(rt *http.Transport) {
			rt.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &bob, nil }
		}, "bob, direct"},
		"Proxy": {func(rt *http.Transport) { rt.Proxy = http.ProxyURL(proxyURL) }, "no certificate, via the proxy"},
	}
	for name, c := range changes {
		for _, pooled := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s, pool %v", name, pooled), func(t *testing.T) {
				p := newPool(t)
				newRT := func() http.RoundTripper {
					if !pooled {
						return &http.Transport{TLSClientConfig: settings.TLS.Clone(), ForceAttemptHTTP2: true}
					}
					rt, err := p.TLSTransport(settings)
					must(t, err)
					return rt
				}
				seen := func(rt http.RoundTripper) string {
					tunnels := proxy.Stats().Tunnels
					utilnet.CloseIdleConnectionsFor(rt)                                             // the next request dials, with what is set now
					if code, err := getVia(rt, f.srv.URL()+"/version"); err != nil || code >= 500 { // 401 without a certificate: seen all the same
						t.Fatalf("pool %v: %d %v", pooled, code, err)
					}
					ri, _ := f.srv.LastRequest("/version")
					who, way := ri.CertCN, "direct"
					if who == "" {
						who = "no certificate"
					}
					if proxy.Stats().Tunnels > tunnels {
						way = "via the proxy"
					}
					return who + ", " + way
				}
				first, second := newRT(), newRT()
				seen(first)
				seen(second)
				found := unwrapToTransport(first)
				if found == nil {
					t.Fatalf("pool %v: unwrapping the first caller's round tripper found no *http.Transport", pooled)
				}
				c.change(found)
				if got := seen(first); got != c.want {
					t.Errorf("pool %v: the first caller, after its change: %s, want %s", pooled, got, c.want)
				}
				if got := seen(second); got != "no certificate, direct" {
					t.Errorf("pool %v: the second caller, after the first changed what it unwrapped: %s, want no certificate, direct", pooled, got)
				}
			})
		}
	}
}
