package sharedtransport

// Wrap decides from what it is given: it sends no request through the
// user's wrappers and asks no function a decorator could answer for. Each
// case compares what the server, the proxies and the user's wrapper see
// through the pool with what they see through client-go alone.

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/url"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestAboveTheHookDecorators: a wrapper added after Wrap unwraps a client's
// round tripper and wraps its Proxy, DialContext or GetClientCertificate in
// place, in a function of its own that calls the original. It gets
// client-go's transport for the client, and the client's requests go
// through what it made of it, as without the pool.
func TestAboveTheHookDecorators(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	bob, err := f.bob.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	proxy1, proxy2 := r.proxies[0].Addr(), r.proxies[1].Addr()
	u2, _ := url.Parse(r.proxies[1].url())
	serverHost := r.srv.Addr()

	inPlace := func(change func(*http.Transport)) func(http.RoundTripper) http.RoundTripper {
		return func(rt http.RoundTripper) http.RoundTripper {
			if t := unwrapTransport(rt); t != nil {
				change(t)
			}
			return rt
		}
	}
	cases := []struct {
		name   string
		change func(*http.Transport)
		want   observation
	}{
		{"Proxy", func(t *http.Transport) {
			orig := t.Proxy
			t.Proxy = func(req *http.Request) (*url.URL, error) {
				u, err := orig(req)
				if req.URL.Host == serverHost {
					return u2, nil
				}
				return u, err
			}
		}, observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 2"}},
		{"DialContext", func(t *http.Transport) {
			orig := t.DialContext
			t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
				if addr == proxy1 {
					addr = proxy2
				}
				return orig(ctx, network, addr)
			}
		}, observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 2"}},
		{"GetClientCertificate", func(t *http.Transport) {
			orig := t.TLSClientConfig.GetClientCertificate
			t.TLSClientConfig.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
				if _, err := orig(cri); err != nil {
					return nil, err
				}
				return &bob, nil
			}
		}, observation{CN: "bob", Proto: h2, Gzip: true, Via: "proxy 1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := newPool(t)
			pair := wrapPair(t, p, func() *rest.Config {
				cfg := r.srv.RestConfig(f.alice)
				cfg.Proxy = proxyTo(r.proxies[0])
				return cfg
			})
			r.check(t, pair, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 1"})
			r.check(t, pair.copies(func(cfg *rest.Config) { cfg.Wrap(inPlace(c.change)) }), &c.want)
		})
	}
}
