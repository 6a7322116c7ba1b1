package sharedtransport

import (
	"net/http"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// perRequestHeader is a WrapTransport of the shape that decides per
// request: in its own RoundTrip it type-asserts the round tripper below it
// to *http.Transport and sends the request over a clone with h as
// ProxyConnectHeader, changed further by change when set.
func perRequestHeader(h http.Header, change func(*http.Transport)) func(http.RoundTripper) http.RoundTripper {
	return func(rt http.RoundTripper) http.RoundTripper { return &perRequestRT{next: rt, h: h, change: change} }
}

type perRequestRT struct {
	next   http.RoundTripper
	h      http.Header
	change func(*http.Transport)
}

func (w *perRequestRT) RoundTrip(req *http.Request) (*http.Response, error) {
	t, ok := w.next.(*http.Transport)
	if !ok {
		return w.next.RoundTrip(req)
	}
	t = t.Clone()
	t.ProxyConnectHeader = w.h
	if w.change != nil {
		w.change(t)
	}
	return t.RoundTrip(req)
}

// TestProbePerRequestWrapper: member configs whose CONNECT header comes from
// a wrapper that acts per request, through a CONNECT proxy that refuses
// tunnels without it, counted at the proxy; a control through client-go
// alone for each case.
func TestProbePerRequestWrapper(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := &proxyHeaderRig{copyRig: newCopyRig(t, testserver.Options{CA: f.ca}), caPEM: f.ca.CertPEM()}
	r.keepConns = true
	member := func(proxy *connectProxy, h http.Header, change func(*http.Transport)) *rest.Config {
		cfg := r.member(proxy, "token-x", nil)
		cfg.Wrap(perRequestHeader(h, change))
		return cfg
	}
	t.Run("one tunnel for many configs, the header on it", func(t *testing.T) {
		proxy := r.newProxy(t)
		p := newPool(t)
		for range 40 {
			cfg := member(proxy, proxyCredA, nil)
			if err := p.Wrap(cfg); err != nil {
				t.Fatal(err)
			}
			r.mustObserve(t, cfg)
		}
		wantTunnels(t, proxy, 1, "40 configs")
		for _, tn := range proxy.Tunnels() {
			if h := tn.Header.Get("Proxy-Authorization"); h != "Basic a" {
				t.Errorf("tunnel %s carried %q", tn.Upstream, h)
			}
		}
	})
	t.Run("client-go alone: a tunnel per request", func(t *testing.T) {
		proxy := r.newProxy(t)
		for range 5 {
			r.mustObserve(t, member(proxy, proxyCredA, nil))
		}
		wantTunnels(t, proxy, 5, "client-go alone")
	})
	t.Run("wrapped twice", func(t *testing.T) {
		proxy := r.newProxy(t)
		p := newPool(t)
		cfg := member(proxy, proxyCredB, nil)
		for range 2 {
			if err := p.Wrap(cfg); err != nil {
				t.Fatal(err)
			}
		}
		for range 3 {
			r.mustObserve(t, cfg)
		}
		wantTunnels(t, proxy, 1, "a config wrapped twice")
		if st := p.Stats(); st.Identities != 1 || st.PassThrough != 0 {
			t.Errorf("pool %+v, want one identity and no pass-through", st)
		}
	})
	t.Run("a wrapper that changes more than CONNECT headers passes the config through", func(t *testing.T) {
		changes := map[string]func(*http.Transport){
			"dialer":      func(c *http.Transport) { c.DialContext = r.dialers[0].dial },
			"server name": func(c *http.Transport) { c.TLSClientConfig.ServerName = "localhost" },
		}
		for name, change := range changes {
			p := newPool(t)
			cfg := member(r.proxies[0], nil, change)
			control := rest.CopyConfig(cfg)
			if err := p.Wrap(cfg); err != nil {
				t.Fatal(err)
			}
			if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
				t.Errorf("%s: pool %+v, want the config passed through", name, st)
			}
			if got, want := r.observe(cfg), r.observe(control); got != want {
				t.Errorf("%s: through the pool %+v, client-go alone %+v", name, got, want)
			}
		}
	})
}

// rtFunc is a round tripper made of a function.
type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// TestProbeStaysInMemory: Wrap's probe of a config's wrappers reaches no
// server, even through a wrapper that ignores the transport it is handed,
// and a wrapper that holds the probe's request does not hold Wrap: both
// configs pass through.
func TestProbeStaysInMemory(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	t.Run("a wrapper with a transport of its own", func(t *testing.T) {
		p := newPool(t)
		cfg := f.srv.RestConfig(f.alice)
		own, err := rest.TransportFor(rest.CopyConfig(cfg))
		if err != nil {
			t.Fatal(err)
		}
		cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper { return own }
		before := f.srv.Stats().Requests
		if err := p.Wrap(cfg); err != nil {
			t.Fatal(err)
		}
		if n := f.srv.Stats().Requests - before; n != 0 {
			t.Errorf("Wrap sent %d requests to the config's server, want 0", n)
		}
		if st := p.Stats(); st.PassThrough != 1 {
			t.Errorf("pool %+v, want the config passed through", st)
		}
	})
	t.Run("a wrapper that holds the request", func(t *testing.T) {
		p := newPool(t)
		cfg := f.srv.RestConfig(f.alice)
		release := make(chan struct{})
		defer close(release)
		cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper {
			return rtFunc(func(*http.Request) (*http.Response, error) {
				<-release // ignores the request's context
				return nil, http.ErrHandlerTimeout
			})
		}
		wrapped := make(chan error, 1)
		go func() { wrapped <- p.Wrap(cfg) }()
		select {
		case err := <-wrapped:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(3 * probeTimeout):
			t.Fatalf("Wrap still waits on a wrapper that holds the probe's request after %v", 3*probeTimeout)
		}
		if st := p.Stats(); st.PassThrough != 1 {
			t.Errorf("pool %+v, want the config passed through", st)
		}
	})
}
