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
	return p.transportFor(cfg, givenBy(opts))
}

func (p *Pool) transportFor(cfg *rest.Config, g given) (http.RoundTripper, error) {
	if p.isClosed() {
		return nil, ErrClosed
	}
	s, share, err := sharingFor(cfg, g, &p.files, p.opts.dialIdentity, false)
	if err != nil {
		return nil, err
	}
	if !share {
		p.passedThrough(cfg, s.pass, s.proxyErr)
		if s.tc == nil {
			return rest.TransportFor(cfg)
		}
		return transport.New(s.tc)
	}
	l, err := p.reg.acquire(s.id)
	if err != nil {
		return nil, err
	}
	base := &configTransport{lease: l, proxy: s.tc.Proxy, clientGo: &clientGoLater{tc: s.tc, id: s.id}}
	return transport.HTTPWrappersForConfig(s.tc, base)
}

// HTTPClientFor is the pool's [rest.HTTPClientFor]: an [http.Client] over
// [Pool.TransportFor], with cfg's Timeout. Pass it with cfg to
// kubernetes.NewForConfigAndClient and the other NewForConfigAndClient
// constructors (dynamic, discovery, metadata).
func (p *Pool) HTTPClientFor(cfg *rest.Config, opts ...CallOption) (*http.Client, error) {
	return p.httpClientFor(cfg, givenBy(opts))
}

func (p *Pool) httpClientFor(cfg *rest.Config, g given) (*http.Client, error) {
	rt, err := p.transportFor(cfg, g)
	if err != nil {
		return nil, err
	}
	if rt == http.DefaultTransport && cfg.Timeout == 0 {
		return http.DefaultClient, nil // as rest.HTTPClientFor
	}
	return &http.Client{Transport: rt, Timeout: cfg.Timeout}, nil
}

// configTransport is what TransportFor puts under client-go's per-request
// layers, and what TLSTransport returns: the identity's shared transport,
// through a lease, and client-go's own transport for what that one does not
// carry.
type configTransport struct {
	lease *lease
	// proxy is the config's Proxy function, asked for every request as
	// net/http asks it over HTTP/1.1 (viaProxy); nil without one.
	proxy func(*http.Request) (*url.URL, error)
	// clientGo is client-go's transport for the config, built when first
	// needed; nil for TLSTransport, which has no config.
	clientGo  *clientGoLater
	handedOut atomic.Bool // WrappedRoundTripper gave clientGo out: every request goes through it
}

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
	shared, err := c.lease.e.current.Load().conns.Shared().Proxy(req) // the pool's own: the environment's, or the route
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
	if c.clientGo != nil {
		c.clientGo.CloseIdleConnections()
	}
	utilnet.CloseIdleConnectionsFor(c.lease)
}

// CancelRequest stops client-go's cancellation here (see
// clientTransport.CancelRequest).
func (c *configTransport) CancelRequest(req *http.Request) {
	if c.clientGo != nil && c.clientGo.built.Load() {
		if cr, ok := c.clientGo.rt.(interface{ CancelRequest(*http.Request) }); ok {
			cr.CancelRequest(req)
		}
	}
}

// clientGoLater is client-go's transport for a config, built at the first
// request that needs it.
type clientGoLater struct {
	tc    *transport.Config
	id    *identity
	once  sync.Once
	rt    http.RoundTripper
	err   error
	built atomic.Bool // rt is there
}

func (l *clientGoLater) get() (http.RoundTripper, error) {
	l.once.Do(func() {
		tc := *l.tc
		if tc.Proxy != nil {
			tc.Proxy = answeredProxy(tc.Proxy)
		}
		rt, err := clientGoTransport(&tc)
		if err != nil {
			l.err = fmt.Errorf("sharedtransport: client-go's transport for the config: %w", err)
			return
		}
		l.rt = l.id.withWrapperHeader(rt)
		l.built.Store(l.err == nil)
	})
	return l.rt, l.err
}

// handOut returns the transport, or, when client-go could not build it, a
// round tripper that fails every request with the reason.
func (l *clientGoLater) handOut() http.RoundTripper {
	if rt, err := l.get(); err == nil {
		return rt
	}
	return l
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
	if l.built.Load() {
		utilnet.CloseIdleConnectionsFor(l.rt)
	}
}

// WrappedRoundTripper returns client-go's transport for the config, what
// code that unwraps the round tripper (utilnet.TLSClientConfig, a wrapper
// that changes the *http.Transport it finds) finds without the pool. Every
// request goes through it from then on (counted in Stats.PassThrough), so
// a change made there reaches only the clients that share it without the
// pool (handedOutTransports). For TLSTransport it is the shared transport,
// as the caller's own would be: apimachinery's UpgradeAwareHandler dials
// upgrades with its dialer and TLS configuration.
func (c *configTransport) WrappedRoundTripper() http.RoundTripper {
	if c.clientGo == nil {
		return c.lease
	}
	p := c.lease.e.env
	if !c.handedOut.Swap(true) {
		p.stats.passThrough.Add(1)
	}
	rt := c.clientGo.handOut()
	p.handedOut.add(unwrapToTransport(rt))
	return rt
}

var _ utilnet.RoundTripperWrapper = &configTransport{}

// sameURL compares two proxy URLs field by field: it runs per request, and
// String would build two strings each time.
func sameURL(a, b *url.URL) bool {
	if a == nil || b == nil || a == b {
		return a == b
	}
	return a.Scheme == b.Scheme && a.Host == b.Host && a.Opaque == b.Opaque && a.Path == b.Path &&
		a.RawQuery == b.RawQuery && sameUser(a.User, b.User)
}

func sameUser(a, b *url.Userinfo) bool {
	if a == nil || b == nil {
		return a == b
	}
	pa, oka := a.Password()
	pb, okb := b.Password()
	return a.Username() == b.Username() && pa == pb && oka == okb
}
