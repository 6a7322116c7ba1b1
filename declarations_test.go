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
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestAboveTheHookDecorators: a wrapper added after Wrap unwraps a client's
// round tripper and changes what it finds in place, in a function of its
// own that calls the original: the proxy, the dialer or the client
// certificate. It gets client-go's cached transport for the config, and
// the client's requests go through what it made of it, as without the
// pool. The change reaches that client alone: the wrapped config's other
// clients, those built before and after, stay on the pool and see what
// they saw (without the pool every client of that cache key would use the
// changed transport, which the pool keeps no record of).
func TestAboveTheHookDecorators(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	u2, _ := url.Parse(r.proxies[1].url())
	serverHost := r.srv.Addr()
	relay := r.relays[0].dial()

	inPlace := func(change func(*http.Transport)) func(http.RoundTripper) http.RoundTripper {
		return func(rt http.RoundTripper) http.RoundTripper {
			if t := unwrapToTransport(rt); t != nil {
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
				if addr == serverHost {
					return relay(ctx, network, addr)
				}
				return orig(ctx, network, addr)
			}
		}, observation{CN: "alice", Proto: h2, Gzip: true, Via: "relay 1"}},
		{"GetClientCertificate", func(t *http.Transport) {
			orig := t.TLSClientConfig.GetClientCertificate
			t.TLSClientConfig.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
				if _, err := orig(cri); err != nil {
					return nil, err
				}
				return &bob, nil
			}
		}, observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// A certificate of its own: client-go's cached transport for
			// it is this case's alone to change.
			alice, err := f.ca.IssueClient("alice")
			must(t, err)
			p := newPool(t)
			pair := wrapPair(t, p, func() *rest.Config { return r.srv.RestConfig(alice) })
			before := [2]*rigClient{r.client(pair.wrapped), r.client(pair.control)}
			if got, control := before[0].observe(), before[1].observe(); got != control || control.Via != "direct" {
				t.Fatalf("before: through the pool %+v, client-go alone %+v (direct)", got, control)
			}
			if st := p.Stats(); st.PassThrough != 0 {
				t.Fatalf("pool %+v: the wrapped config's clients do not share, the test tests nothing", st)
			}
			was := before[0].observe()
			r.check(t, pair.copies(func(cfg *rest.Config) { cfg.Wrap(inPlace(c.change)) }), &c.want)
			after := r.client(pair.wrapped)
			for name, client := range map[string]*rigClient{"built before": before[0], "built after": after} {
				if got := client.observe(); got != was {
					t.Errorf("a client %s, through the pool: %+v, want what it saw before, %+v (client-go alone: %+v)", name, got, was, before[1].observe())
				}
			}
		})
	}
}

// TestWrappersBeforeWrap: wrappers already on a config when it is wrapped
// are code the pool cannot read. Undeclared, the config passes through and
// every wrapper sees and does exactly what it does with client-go alone:
// Wrap builds nothing, calls no wrapper and sends no request.
func TestWrappersBeforeWrap(t *testing.T) {
	f := newFixture(t, testserver.Options{ClientAuth: testserver.VerifyClientCertIfGiven})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	serverHost := strings.TrimPrefix(f.srv.URL(), "https://")
	cases := []struct {
		name string
		// wrapper returns a new wrapper, with state of its own, for cfg.
		wrapper func(cfg *rest.Config) transport.WrapperFunc
		// config changes the config before the wrapper is added.
		config func(cfg *rest.Config)
		want   string // what the server sees through client-go alone; "": as the client-go version has it
	}{
		{name: "keeps the first transport it is handed", wrapper: func(*rest.Config) transport.WrapperFunc {
			var first http.RoundTripper
			return func(rt http.RoundTripper) http.RoundTripper {
				if first == nil {
					first = rt
				}
				return first
			}
		}, want: "alice"},
		{name: "presents another certificate to its own server only", wrapper: func(*rest.Config) transport.WrapperFunc {
			return func(rt http.RoundTripper) http.RoundTripper {
				t := unwrapToTransport(rt)
				if t == nil {
					return rt
				}
				// A transport of its own: a clone would hand its HTTP/2
				// connections to t's pool.
				asBob := &http.Transport{TLSClientConfig: t.TLSClientConfig.Clone(), ForceAttemptHTTP2: true}
				asBob.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &bob, nil }
				return rtFunc(func(req *http.Request) (*http.Response, error) {
					if req.URL.Host == serverHost {
						return asBob.RoundTrip(req)
					}
					return rt.RoundTrip(req)
				})
			}
		}, want: "bob"},
		{name: "type-asserts an *http.Transport", wrapper: func(*rest.Config) transport.WrapperFunc {
			return func(rt http.RoundTripper) http.RoundTripper {
				_ = rt.(*http.Transport).TLSClientConfig
				return rt
			}
		}}, // client-go from v0.36 hands wrappers a wrapper of its own: the assertion panics there too
		{name: "adds a CA to the roots in place", config: func(cfg *rest.Config) {
			other, err := testserver.NewCA("other-ca")
			must(t, err)
			cfg.CAData = other.CertPEM()
		}, wrapper: func(*rest.Config) transport.WrapperFunc {
			return func(rt http.RoundTripper) http.RoundTripper {
				if t := unwrapToTransport(rt); t != nil {
					t.TLSClientConfig.RootCAs.AddCert(f.ca.Cert)
				}
				return rt
			}
		}, want: "alice"},
		{name: "has a transport of its own", wrapper: func(cfg *rest.Config) transport.WrapperFunc {
			own, err := rest.TransportFor(rest.CopyConfig(cfg))
			must(t, err)
			return func(http.RoundTripper) http.RoundTripper { return own }
		}, want: "alice"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var seen [2]wrapperSeen
			cfgs := [2]*rest.Config{}
			for i := range cfgs {
				cfg := f.srv.RestConfig(f.alice)
				if c.config != nil {
					c.config(cfg)
				}
				cfg.Wrap(seen[i].counting(c.wrapper(cfg)))
				cfgs[i] = cfg
			}
			p := newPool(t)
			before := f.srv.Stats().Requests
			must(t, p.Wrap(cfgs[0]))
			if n := f.srv.Stats().Requests - before; n != 0 || seen[0].built.Load() != 0 {
				t.Errorf("Wrap sent %d requests and built %d wrappers, want none", n, seen[0].built.Load())
			}
			if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
				t.Errorf("pool %+v, want the config passed through", st)
			}
			for range 3 {
				got, control := observeCN(f, cfgs[0]), observeCN(f, cfgs[1])
				if got != control || c.want != "" && control != c.want {
					t.Errorf("through the pool %q, through client-go alone %q (want %q)", got, control, c.want)
				}
			}
			if seen[0].built.Load() != seen[1].built.Load() || seen[0].requests.Load() != seen[1].requests.Load() {
				t.Errorf("the wrapper saw %d builds and %d requests through the pool, %d and %d through client-go alone",
					seen[0].built.Load(), seen[0].requests.Load(), seen[1].built.Load(), seen[1].requests.Load())
			}
		})
	}
}

// TestCountingWrapperDeclared: two configs with a request-counting wrapper,
// declared, share one identity, and the wrapper counts exactly the requests
// sent; as many as through client-go alone.
func TestCountingWrapperDeclared(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	var pooled, alone wrapperSeen
	identity := func(rt http.RoundTripper) http.RoundTripper { return rt }
	for range 2 {
		cfg, control := f.srv.RestConfig(f.alice), f.srv.RestConfig(f.alice)
		cfg.Wrap(pooled.counting(identity))
		control.Wrap(alone.counting(identity))
		must(t, p.Wrap(cfg, WithPerRequestWrappers()))
		for range 3 {
			if got, want := observeCN(f, cfg), observeCN(f, control); got != want || got != "alice" {
				t.Fatalf("through the pool %q, through client-go alone %q, want alice", got, want)
			}
		}
	}
	if got, want := pooled.requests.Load(), alone.requests.Load(); got != 6 || want != 6 {
		t.Errorf("the wrapper counted %d requests through the pool, %d through client-go alone; 6 were sent", got, want)
	}
	if st := p.Stats(); st.Identities != 1 || st.PassThrough != 0 {
		t.Errorf("pool %+v, want one identity and no pass-through", st)
	}
}

// wrapperSeen counts what a user's wrapper sees: how often it is built (once
// per client) and the requests sent through what it returned.
type wrapperSeen struct{ built, requests atomic.Int64 }

func (s *wrapperSeen) counting(next transport.WrapperFunc) transport.WrapperFunc {
	return func(rt http.RoundTripper) http.RoundTripper {
		s.built.Add(1)
		inner := next(rt)
		return rtFunc(func(req *http.Request) (*http.Response, error) {
			s.requests.Add(1)
			return inner.RoundTrip(req)
		})
	}
}

// observeCN sends one request through a new clientset of cfg and returns
// the client certificate the server saw, or the class of error; a panic
// while building or sending is an outcome too.
func observeCN(f *fixture, cfg *rest.Config) (seen string) {
	defer func() {
		if r := recover(); r != nil {
			seen = "panic"
		}
	}()
	cs, err := kubernetes.NewForConfig(rest.CopyConfig(cfg))
	if err != nil {
		return errorClass(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	before := f.srv.Stats().Requests
	ssr, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return errorClass(err)
	}
	if f.srv.Stats().Requests == before {
		return "the server saw no request"
	}
	return ssr.Status.UserInfo.Username
}

// rtFunc is a round tripper made of a function.
type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// TestLegacyCancelKeepsSharing: net/http cancels a request that runs into
// http.Client.Timeout through CancelRequest when its timer fires first, and
// client-go's round trippers pass that on by unwrapping to the first round
// tripper that can cancel. The pool's round tripper stops it there, so the
// client keeps the shared transport.
func TestLegacyCancelKeepsSharing(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	hc := httpClient(t, p, f.srv.RestConfig(f.alice))
	get := func() {
		t.Helper()
		resp, err := hc.Get(f.srv.URL() + "/api/v1/nodes")
		must(t, err)
		resp.Body.Close()
	}
	get()
	canceler, ok := hc.Transport.(interface{ CancelRequest(*http.Request) })
	if !ok {
		t.Fatalf("client-go's round tripper %T has no CancelRequest: the test's premise is wrong", hc.Transport)
	}
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL()+"/api/v1/nodes", nil)
	canceler.CancelRequest(req) // what net/http's timer does
	get()
	if st := p.Stats(); st.PassThrough != 0 || st.Dials != 1 {
		t.Errorf("pool %+v: want the client still on the shared transport, on its one connection", st)
	}
}

// TestUndeclaredWrappersLoggedOnce: configs passed through for undeclared
// wrappers are logged once per pool, at V(2), with the way to share them.
func TestUndeclaredWrappersLoggedOnce(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	logs := &logLines{}
	p := newPool(t, WithLogger(logs.loggerAt(2)))
	for range 3 {
		cfg := f.srv.RestConfig(f.alice)
		cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return rt })
		must(t, p.Wrap(cfg))
	}
	if n := logs.count("Wrap"); n != 1 || p.Stats().PassThrough != 3 {
		t.Errorf("3 configs with undeclared wrappers: %d log lines naming Wrap, %d passed through; want 1 and 3",
			n, p.Stats().PassThrough)
	}
}
