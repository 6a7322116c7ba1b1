// The pool's counterparts of rest.TransportFor and rest.HTTPClientFor, for
// code that builds a config per request and asks for a round tripper itself.

package sharedtransport

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// TransportFor is [Pool.TransportFor] on the package's default pool.
func TransportFor(cfg *rest.Config, opts ...CallOption) (http.RoundTripper, error) {
	return defaultPool().TransportFor(cfg, opts...)
}

// HTTPClientFor is [Pool.HTTPClientFor] on the package's default pool.
func HTTPClientFor(cfg *rest.Config, opts ...CallOption) (*http.Client, error) {
	return defaultPool().HTTPClientFor(cfg, opts...)
}

// TransportFor is the pool's [rest.TransportFor]: a round tripper that sends
// cfg's requests over the pool's transport for cfg's TLS identity, under
// the per-request layers client-go itself builds for cfg (user agent,
// bearer token and token file, basic auth, impersonation, auth and exec
// providers, cfg.WrapTransport). client-go builds no TLS transport for cfg,
// so a config built per request costs what a config client-go caches costs.
// Use it where code asks for a round tripper or a client itself; [Pool.Wrap]
// is for code that hands the config to client-go. The round tripper keeps
// the identity alive; later changes to cfg do not reach it.
//
// A config's Proxy function is asked for every request, as net/http asks
// it over HTTP/1.1, and the request goes the way that answer says; an
// error fails that request alone. It is also asked once when cfg is given,
// to key the identity. A request the function sends where the shared
// transport goes uses that transport; others go through client-go's own
// transport for cfg, built at the first of them.
//
// A config the pool cannot share (its own Transport, one client-go sends
// through [http.DefaultTransport], a custom Dial without
// [WithDialIdentity], a Proxy function that fails) gets what
// [rest.TransportFor] gives, counted in [Stats].PassThrough. TransportFor
// reads the certificate, key and CA files cfg names; its error names the
// file that is missing, unreadable or invalid.
func (p *Pool) TransportFor(cfg *rest.Config, opts ...CallOption) (http.RoundTripper, error) {
	return p.transportFor(cfg, declarationOf(opts))
}

func (p *Pool) transportFor(cfg *rest.Config, d declaration) (http.RoundTripper, error) {
	s, l, err := p.reg.share(cfg, d, false)
	switch {
	case err != nil:
		return nil, err
	case l == nil && s.tc == nil: // its own Transport, which rest.TransportFor wraps
		return rest.TransportFor(cfg)
	case l == nil:
		return transport.New(s.tc)
	}
	later := &clientGoLater{tc: s.tc, header: s.id.connectHeader, inUse: l.material}
	return transport.HTTPWrappersForConfig(s.tc, &configTransport{lease: l, proxy: s.tc.Proxy, clientGo: later})
}

// HTTPClientFor is the pool's [rest.HTTPClientFor]: an [http.Client] over
// [Pool.TransportFor], with cfg's Timeout. Pass it with cfg to
// kubernetes.NewForConfigAndClient and the other NewForConfigAndClient
// constructors (dynamic, discovery, metadata).
func (p *Pool) HTTPClientFor(cfg *rest.Config, opts ...CallOption) (*http.Client, error) {
	return p.httpClientFor(cfg, declarationOf(opts))
}

func (p *Pool) httpClientFor(cfg *rest.Config, d declaration) (*http.Client, error) {
	rt, err := p.transportFor(cfg, d)
	if err != nil {
		return nil, err
	}
	if rt == http.DefaultTransport && cfg.Timeout == 0 {
		return http.DefaultClient, nil // as rest.HTTPClientFor
	}
	return &http.Client{Transport: rt, Timeout: cfg.Timeout}, nil
}

// configTransport is what TransportFor puts under client-go's per-request
// layers: the identity's shared transport, through a lease, and client-go's
// own transport for the config for what that one does not carry.
type configTransport struct {
	lease *lease
	// proxy is the config's Proxy function, asked for every request as
	// net/http asks it over HTTP/1.1 (viaProxy); nil without one.
	proxy    func(*http.Request) (*url.URL, error)
	clientGo *clientGoLater
	// handedOut: WrappedRoundTripper gave clientGo out: every request goes
	// through it.
	handedOut atomic.Bool
}

func (*configTransport) pooled() {}

func (c *configTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	switch {
	case c.handedOut.Load():
		return c.clientGo.RoundTrip(req)
	case c.proxy == nil:
		return c.lease.RoundTrip(req)
	}
	return c.viaProxy(req)
}

// viaProxy sends req the way the config's Proxy function answers for it:
// over the shared transport when that goes the same way, else through
// clientGo, which is not asked again. Its error fails the request, as in
// net/http.
func (c *configTransport) viaProxy(req *http.Request) (*http.Response, error) {
	u, err := c.proxy(req)
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	shared, err := c.lease.sharedProxy(req) // the pool's own: the environment's, or the route
	if err != nil || !sameURL(u, shared) {
		return c.clientGo.RoundTrip(withAskedProxy(req, u))
	}
	return c.lease.RoundTrip(req)
}

// askedProxyKey keys, in a request's context, the answer the Proxy function
// gave for the request, so that clientGoLater's transport does not ask again.
type askedProxyKey struct{}

type askedProxy struct{ url *url.URL }

func withAskedProxy(req *http.Request, u *url.URL) *http.Request {
	return req.WithContext(context.WithValue(req.Context(), askedProxyKey{}, askedProxy{u}))
}

// answeredProxy returns proxy, answering a request whose answer it gave
// already (withAskedProxy) without asking again.
func answeredProxy(proxy func(*http.Request) (*url.URL, error)) func(*http.Request) (*url.URL, error) {
	return func(req *http.Request) (*url.URL, error) {
		if a, ok := req.Context().Value(askedProxyKey{}).(askedProxy); ok {
			return a.url, nil
		}
		return proxy(req)
	}
}

// CloseIdleConnections closes idle connections of both transports the
// round tripper may use.
func (c *configTransport) CloseIdleConnections() {
	c.clientGo.CloseIdleConnections()
	utilnet.CloseIdleConnectionsFor(c.lease)
}

// CancelRequest stops client-go's cancellation, which unwraps to the first
// round tripper that has the method, here rather than at
// WrappedRoundTripper: requests on the shared transport end with their
// context.
func (c *configTransport) CancelRequest(req *http.Request) {
	if cr, ok := c.clientGo.built().(interface{ CancelRequest(*http.Request) }); ok {
		cr.CancelRequest(req)
	}
}

// clientGoLater is client-go's transport for a config, built at the first
// request or unwrap that needs it. Where client-go cannot build it from the
// files the config names now (they are being rewritten, say), it is built
// from the material the pool holds for them, what the client was built
// with. A build that fails is not kept: the next caller builds again.
type clientGoLater struct {
	tc     *transport.Config
	header http.Header      // added to CONNECT requests by a declared wrapper (withConnectHeader)
	inUse  func() *material // the identity's current material
	// mu guards rt. It is held across the build: a caller waiting for it
	// waits for the transport it needs.
	mu sync.Mutex
	rt http.RoundTripper // nil until built
}

func (l *clientGoLater) get() (http.RoundTripper, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.rt != nil {
		return l.rt, nil
	}
	tc := *l.tc
	if tc.Proxy != nil {
		tc.Proxy = answeredProxy(tc.Proxy)
	}
	rt, err := clientGoTransport(&tc)
	if err != nil {
		rt, err = clientGoTransport(fromMaterial(tc, l.inUse()))
	}
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: client-go's transport for the config: %w", err)
	}
	l.rt = withConnectHeader(rt, l.header)
	return l.rt, nil
}

// built returns the transport if it was built, else nil.
func (l *clientGoLater) built() http.RoundTripper {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.rt
}

// fromMaterial returns tc with m's bytes in place of the files it names.
func fromMaterial(tc transport.Config, m *material) *transport.Config {
	if tc.TLS.CAFile != "" {
		tc.TLS.CAFile, tc.TLS.CAData = "", m.caPEM
	}
	if tc.TLS.CertFile != "" {
		tc.TLS.CertFile, tc.TLS.CertData = "", m.certPEM
	}
	if tc.TLS.KeyFile != "" {
		tc.TLS.KeyFile, tc.TLS.KeyData = "", m.keyPEM
	}
	return &tc
}

func (l *clientGoLater) RoundTrip(req *http.Request) (*http.Response, error) {
	rt, err := l.get()
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	return rt.RoundTrip(req)
}

// CloseIdleConnections closes the transport's idle connections, if it was
// built.
func (l *clientGoLater) CloseIdleConnections() {
	if rt := l.built(); rt != nil {
		utilnet.CloseIdleConnectionsFor(rt)
	}
}

// WrappedRoundTripper returns client-go's transport for the config, as
// rest.TransportFor gives it: code that unwraps the round tripper
// (utilnet.TLSClientConfig, a wrapper that changes the *http.Transport it
// finds) may change it, and the change reaches no other caller. This round
// tripper's requests go through it from then on (counted in
// Stats.PassThrough). While the files the config names are being
// rewritten, it is built from the material the pool holds for them, what
// the client was built with.
func (c *configTransport) WrappedRoundTripper() http.RoundTripper {
	rt, err := c.clientGo.get()
	if err != nil {
		return c.clientGo
	}
	if !c.handedOut.Swap(true) {
		c.lease.countPassThrough()
	}
	return rt
}

var _ utilnet.RoundTripperWrapper = &configTransport{}

// sameURL reports whether two proxy URLs are the same, most often without
// building their strings: it runs per request.
func sameURL(a, b *url.URL) bool {
	return a == b || a != nil && b != nil && (*a == *b || a.String() == b.String())
}
