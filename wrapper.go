package sharedtransport

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"weak"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// hook is what Wrap installs as the innermost rest.Config.WrapTransport. It
// refers to its lease weakly. client-go keeps the WrapTransport of the first
// config of every TLS cache key for as long as it keeps the transport it
// cached for that key: the GetClientCertificate closure of the cached
// transport's tls.Config captures the whole transport.Config. Before v0.36
// (and with the ClientsAllowTLSCacheGC gate off) that cache is never pruned,
// so a hook holding its lease strongly kept every identity with a client
// certificate alive for good, connections and memory, once a client had been
// built from it: a deleted member cluster, a rotated-away Secret. Instead the
// wrapped config holds the lease (Wrap attaches it), clients hold it through
// the round tripper the hook returns, and a hook whose lease was collected
// takes a new one.
type hook struct {
	pool  *Pool
	id    *identity
	probe *http.Request

	mu    sync.Mutex // guards lease
	lease weak.Pointer[lease]
}

func newHook(p *Pool, id *identity, probe *http.Request, l *lease) *hook {
	return &hook{pool: p, id: id, probe: probe, lease: weak.Make(l)}
}

func (h *hook) wrap(rt http.RoundTripper) http.RoundTripper {
	l, err := h.current()
	switch {
	case errors.Is(err, ErrClosed):
		return closedRoundTripper{}
	case err != nil:
		// The identity's files went bad since Wrap: client-go's own
		// transport still works.
		h.pool.opts.logger.Error(err, "Config left to client-go's own transport")
		h.pool.stats.passThrough.Add(1)
		return rt
	}
	return l.wrap(rt)
}

// current returns the hook's lease, taking a new one when it was collected.
func (h *hook) current() (*lease, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if l := h.lease.Value(); l != nil {
		return l, nil
	}
	l, err := h.pool.acquire(h.id, h.probe)
	if err != nil {
		return nil, err
	}
	h.lease = weak.Make(l)
	return l, nil
}

type closedRoundTripper struct{}

func (closedRoundTripper) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
}

// wrap is the lease's part of the hook.
// client-go calls it with the transport it built for a config: the wrapped
// config, or a copy of it (rest.CopyConfig copies WrapTransport). The shared
// transport replaces rt only when rt is a client-go TLS transport for this
// very identity; anything else (SPDY and websocket round trippers, a
// user-supplied Transport, a copy whose credentials changed) passes through.
func (l *lease) wrap(rt http.RoundTripper) http.RoundTripper {
	if l.e.closed.Load() {
		return l // fails every request with ErrClosed, rather than silently leaving the pool
	}
	if !l.matches(rt) {
		l.e.pool.stats.passThrough.Add(1)
		return rt
	}
	if l.e.id.host != "" {
		return &hostRoundTripper{lease: l, other: rt}
	}
	return l
}

// matches reports whether rt, built by client-go, authenticates and routes
// exactly as the lease's identity does. This is what keeps a copy of a
// wrapped config that was given other credentials off the original's
// connections.
func (l *lease) matches(rt http.RoundTripper) bool {
	got := httpTransport(rt)
	if got == nil {
		return false
	}
	if l.e.verified(got) {
		return true
	}
	// One first look at a time per identity: client-go's certificate-file
	// refresher returns its certificate outside its lock, so concurrent
	// askers (the first clients of a new config, built at once) race inside
	// client-go.
	l.e.verifyMu.Lock()
	defer l.e.verifyMu.Unlock()
	if l.e.verified(got) {
		return true
	}
	g := l.e.current.Load()
	gotTLS, wantTLS := got.TLSClientConfig, g.transport.TLSClientConfig
	if gotTLS == nil || wantTLS == nil {
		if gotTLS != wantTLS {
			return false
		}
	} else {
		if gotTLS.ServerName != wantTLS.ServerName || gotTLS.InsecureSkipVerify != wantTLS.InsecureSkipVerify {
			return false
		}
		// Roots first: asking client-go for its certificate is not free.
		if !l.e.trustsRoots(g, gotTLS.RootCAs) {
			return false
		}
		leaf, err := clientLeaf(gotTLS)
		if err != nil || !l.e.trustsLeaf(g, leaf) {
			return false
		}
	}
	if !sameProxy(got.Proxy, g.transport.Proxy, l.probe) {
		return false
	}
	l.e.remember(got)
	return true
}

// httpTransport unwraps rt to the *http.Transport client-go built, or nil.
// client-go hands WrapTransport its TLS transport wrapped (the cache's
// garbage-collection and CA-reload holders), so a bare type assertion is not
// enough.
func httpTransport(rt http.RoundTripper) *http.Transport {
	for range 8 {
		switch t := rt.(type) {
		case *http.Transport:
			return t
		case utilnet.RoundTripperWrapper:
			rt = t.WrappedRoundTripper()
		default:
			return nil
		}
	}
	return nil
}

// clientLeaf returns the DER of the client certificate c presents, or nil.
func clientLeaf(c *tls.Config) ([]byte, error) {
	var cert *tls.Certificate
	switch {
	case c.GetClientCertificate != nil:
		var err error
		if cert, err = c.GetClientCertificate(&tls.CertificateRequestInfo{}); err != nil {
			return nil, err
		}
	case len(c.Certificates) > 0:
		cert = &c.Certificates[0]
	}
	if cert == nil || len(cert.Certificate) == 0 {
		return nil, nil
	}
	return cert.Certificate[0], nil
}

func sameProxy(got, want func(*http.Request) (*url.URL, error), probe *http.Request) bool {
	if got == nil || want == nil {
		return (got == nil) == (want == nil)
	}
	g, err1 := got(probe)
	w, err2 := want(probe)
	return err1 == nil && err2 == nil && urlString(g) == urlString(w)
}

// RoundTrip sends req through the identity's current transport. A request
// whose generation a rotation closed before it was sent (WithDrainTimeout
// over, or zero) is sent on the current one; ErrClosed means the pool (or
// the identity) was closed.
func (l *lease) RoundTrip(req *http.Request) (*http.Response, error) {
	for resends := 0; ; resends++ {
		if l.e.closed.Load() {
			return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
		}
		resp, err := l.e.current.Load().roundTrip(l, req)
		switch {
		case err == nil:
			return resp, nil
		case l.e.closed.Load():
			// Closed while the request ran: say so, rather than whatever
			// the connection that Close cut reported.
			return nil, fmt.Errorf("%w while the request ran: %v", ErrClosed, err)
		case !errors.Is(err, errRetired) || resends == maxResends:
			return nil, err
		}
		if req, err = resendable(req, err); err != nil {
			return nil, err
		}
	}
}

// WrappedRoundTripper lets client-go helpers (utilnet.TLSClientConfig) see
// the shared transport: the one that carries every request but upgrades,
// which go over an HTTP/1.1 transport of their own. CloseIdleConnections
// (keepalive.go) reaches both.
func (l *lease) WrappedRoundTripper() http.RoundTripper { return l.e.current.Load().transport }

var _ utilnet.RoundTripperWrapper = &lease{}

// hostRoundTripper serves identities whose Proxy was sampled for one host:
// only requests to that host may use the shared transport. Requests to other
// hosts (a copy of the config pointed elsewhere) go where client-go would
// send them.
type hostRoundTripper struct {
	*lease
	other http.RoundTripper
}

func (h *hostRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != h.e.id.host {
		return h.other.RoundTrip(req)
	}
	return h.lease.RoundTrip(req)
}

var _ utilnet.RoundTripperWrapper = &hostRoundTripper{}

// WrapConfigFn wraps cfg and returns it, in the shape of cli-runtime's
// genericclioptions.ConfigFlags.WrapConfigFn. On error it logs, counts
// [Stats].WrapErrors and returns cfg unchanged, so a CLI keeps working with
// client-go's own transport.
func (p *Pool) WrapConfigFn(cfg *rest.Config) *rest.Config {
	if err := p.Wrap(cfg); err != nil {
		p.stats.wrapErrors.Add(1)
		p.opts.logger.Error(err, "Config left unwrapped; it uses client-go's own transport")
	}
	return cfg
}

// WrapClientConfig returns a clientcmd.ClientConfig whose ClientConfig method
// returns configs wrapped by p: the drop-in for code built on
// clientcmd.NewNonInteractiveDeferredLoadingClientConfig and friends.
func (p *Pool) WrapClientConfig(cc clientcmd.ClientConfig) clientcmd.ClientConfig {
	return &clientConfig{inner: cc, pool: p}
}

type clientConfig struct {
	inner clientcmd.ClientConfig
	pool  *Pool
}

func (c *clientConfig) ClientConfig() (*rest.Config, error) {
	cfg, err := c.inner.ClientConfig()
	if err != nil {
		return nil, err
	}
	if err := c.pool.Wrap(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}

func (c *clientConfig) RawConfig() (clientcmdapi.Config, error) { return c.inner.RawConfig() }
func (c *clientConfig) Namespace() (string, bool, error)        { return c.inner.Namespace() }
func (c *clientConfig) ConfigAccess() clientcmd.ConfigAccess    { return c.inner.ConfigAccess() }
