// Wrap, the hook it installs in a config's WrapTransport, and the hook's
// rule for every client built from the config or a copy: a client rides the
// shared transport only when client-go hands the hook the transport its own
// cache holds for the wrapped config.

package sharedtransport

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"weak"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	clientgofeatures "k8s.io/client-go/features"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// Wrap installs the package's default pool in cfg: the one-line drop-in for
// code that already builds a [rest.Config]. See [Pool.Wrap].
func Wrap(cfg *rest.Config, opts ...CallOption) error { return defaultPool().Wrap(cfg, opts...) }

// Wrap makes every client built from cfg, and from copies that keep its TLS
// identity, share this pool's transport for that identity. It installs a
// hook as the innermost of cfg.WrapTransport, so wrappers set before or after
// still see every request, and never sets cfg.Transport.
//
// Configs it cannot share pass through untouched, counted in
// [Stats].PassThrough: a config with its own Transport, one client-go sends
// through [http.DefaultTransport] anyway, undeclared wrappers (see
// [CallOption]), and a Proxy or Dial function, which the hook cannot tell
// from a copy's: share those with [Pool.HTTPClientFor] or
// [Pool.TransportFor], which are given the config.
//
// For a config it shares, Wrap reads the certificate, key and CA files cfg
// names; its error names the file that is missing, unreadable or invalid.
// Wrap of a config this pool wrapped already changes nothing.
func (p *Pool) Wrap(cfg *rest.Config, opts ...CallOption) error {
	return p.wrap(cfg, declarationOf(opts))
}

func (p *Pool) wrap(cfg *rest.Config, d declaration) error {
	s, l, err := p.reg.share(cfg, d, true) // reads and checks the material first: its errors name the file
	if s.pass == functionsInWrap {
		p.functionsOnce.Do(func() {
			p.opts.logger.V(2).Info("Config passes through Wrap: it has a Proxy or Dial function, which the hook cannot tell from a copy's; "+
				"build its clients with HTTPClientFor or TransportFor to share its transport (logged once)", "host", redactHost(cfg.Host))
		})
	}
	if err != nil || l == nil {
		return err
	}
	// A rotation between the lease and newHook has the hook ask client-go
	// again at the first client.
	h, err := newHook(p.reg, s, l)
	if err != nil {
		return err
	}
	p.reg.holdLease(cfg, l)
	cfg.WrapTransport = transport.Wrappers(h.wrap, cfg.WrapTransport)
	return nil
}

// hook is the innermost rest.Config.WrapTransport Wrap installs in a config
// client-go caches (no Proxy, no Dial). client-go calls it with the
// transport it built for a client of the config, of a copy (rest.CopyConfig
// copies WrapTransport), or of the config changed in place. The hook sees
// that transport, never the config: a client whose transport is the one
// client-go's cache holds for the wrapped config agrees with it on every
// field of client-go's key, and so on everything that reaches the
// connection. Any other transport (another certificate, a Proxy or Dial
// added, SPDY) passes through. Every field of the identity is one
// client-go's key holds the same way (docs/design.md, "What client-go's key
// holds"), except the CA of a watched file.
//
// Where client-go keys a watched CA file by its bytes (caFileByPath false),
// a copy carrying those bytes inline, or in another file, is handed the
// wrapped config's cached transport and must never follow the file it does
// not name: a client rides the shared transport only when client-go's
// transport for it trusts exactly the shared one's roots (trustsAlike), and
// only while the identity's CA stays what it was then (clientTransport.sameCA).
//
// The hook holds its lease weakly (weakLease).
type hook struct {
	reg  *registry
	id   *identity
	base *transport.Config // the wrapped config's, as Wrap found it: what client-go's cache is asked for

	lease weakLease

	mu sync.Mutex // guards askedFor
	// askedFor is the seq of the generation current when the hook last
	// asked client-go's cache for base (the answer is kept in
	// entry.clientGo).
	askedFor uint64
}

// newHook prepares the hook for s, holding l weakly. It asks client-go for
// its transport for s.tc unless a config of the identity asked while the
// current generation was: client-go reads the files when asked, and a
// config per request would have it read them for every config.
func newHook(r *registry, s sharing, l *lease) (*hook, error) {
	h := &hook{reg: r, id: s.id, base: s.tc}
	h.lease.p = weak.Make(l)
	if seq := l.e.current.Load().seq; !l.e.clientGoFound(seq, nil) {
		if err := h.askClientGo(l.e, seq); err != nil {
			return nil, fmt.Errorf("sharedtransport: %w", err)
		}
	}
	return h, nil
}

// askClientGo asks client-go's cache for its transport for h.base, once
// while the generation numbered g is current, and keeps the answer in e.
// It asks without the lock: client-go reads the files. The answer is kept
// before askedFor is set, for concurrent calls that see askedFor.
func (h *hook) askClientGo(e *entry, g uint64) error {
	h.mu.Lock()
	asked := h.askedFor == g
	h.mu.Unlock()
	if asked {
		return nil
	}
	rt, err := clientGoTransport(h.base)
	if err != nil {
		return err
	}
	e.rememberClientGo(g, rt)
	h.mu.Lock()
	h.askedFor = g
	h.mu.Unlock()
	return nil
}

func (h *hook) wrap(rt http.RoundTripper) http.RoundTripper {
	if _, ok := rt.(pooled); ok {
		return rt // a hook installed later, or TransportFor, already decided
	}
	l, err := h.lease.get(h.reg, h.id)
	switch {
	case errors.Is(err, ErrClosed):
		return closedRoundTripper{}
	case err != nil:
		h.reg.opts.logger.Error(err, "Config left to client-go's own transport")
		h.reg.stats.passThrough.Add(1)
		return rt
	}
	if l.e.closed.Load() {
		return closedRoundTripper{}
	}
	g, ok := h.cachedByClientGo(rt, l.e)
	pinCA := h.id.src.caFile != "" && !caFileByPath()
	if !ok || pinCA && !trustsAlike(rt, g.transports.Shared().TLSClientConfig) {
		h.reg.stats.passThrough.Add(1)
		return rt // SPDY, websocket, a caller's own transport, another identity
	}
	return &clientTransport{lease: l, pinCA: pinCA, ca: g.ca, clientGo: withConnectHeader(rt, h.id.connectHeader)}
}

// caFileByPath reports whether client-go keys a CA file named without data
// by its path: from v0.36, while ClientsAllowCARotation is on (the default).
// Before v0.36 Enabled panics on the unknown gate, and the file is keyed by
// its bytes.
func caFileByPath() (byPath bool) {
	defer func() {
		if recover() != nil {
			byPath = false
		}
	}()
	return clientgofeatures.FeatureGates().Enabled("ClientsAllowCARotation")
}

// trustsAlike reports whether rt, client-go's transport for a client,
// trusts exactly the roots ours trusts. Both come from
// transport.TLSConfigFor, so equal CA bytes give equal pools.
func trustsAlike(rt http.RoundTripper, ours *tls.Config) bool {
	theirs, err := utilnet.TLSClientConfig(rt)
	if err != nil || theirs == nil || ours == nil {
		return false
	}
	return theirs.RootCAs.Equal(ours.RootCAs)
}

// cachedByClientGo reports whether rt is a transport client-go's cache holds now for
// a wrapped config of the identity, and returns the current generation. An
// answer holds for the generation current when client-go was asked: after
// a rotation client-go is asked again, since before v0.36 it keys a CA by
// its bytes, and a copy with the old bytes inline would match the
// transport it held for the files before.
func (h *hook) cachedByClientGo(rt http.RoundTripper, e *entry) (*generation, bool) {
	if e.files.bad() {
		// A client built while the files are rejected meets them as it
		// would without the pool.
		return nil, false
	}
	g := e.current.Load()
	if e.clientGoFound(g.seq, rt) {
		return g, true
	}
	_ = h.askClientGo(e, g.seq) // a failure leaves rt to client-go
	return g, e.clientGoFound(g.seq, rt)
}

// clientGoFound reports whether client-go's cache held rt for a config of
// e while the generation numbered g was current; for a nil rt, whether any answer was kept for g.
func (e *entry) clientGoFound(g uint64, rt http.RoundTripper) bool {
	e.clientGoMu.Lock()
	defer e.clientGoMu.Unlock()
	if e.clientGoFor != g {
		return false
	}
	if rt == nil {
		return len(e.clientGo) > 0
	}
	return slices.Contains(e.clientGo, rt)
}

// rememberClientGo keeps that client-go's cache holds rt for a config of e
// while the generation numbered g is current.
func (e *entry) rememberClientGo(g uint64, rt http.RoundTripper) {
	e.clientGoMu.Lock()
	defer e.clientGoMu.Unlock()
	if e.clientGoFor != g {
		e.clientGoFor, e.clientGo = g, nil
	}
	if !slices.Contains(e.clientGo, rt) {
		e.clientGo = append(e.clientGo, rt)
	}
}

type closedRoundTripper struct{}

func (closedRoundTripper) pooled() {}

func (closedRoundTripper) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
}

// clientTransport is what one client gets from the hook: the shared
// transport, until a wrapper above the hook asks for the transport below it.
type clientTransport struct {
	lease    *lease
	clientGo http.RoundTripper // what client-go built for this client
	// pinCA: client-go keys the CA file by its bytes, so the client rides
	// the shared transport only while the identity's CA digest is ca, the
	// CA client-go's transport for it was found to trust.
	pinCA   bool
	ca      digest
	caMoved atomic.Bool // the CA changed: requests go through clientGo
	// handedOut: WrappedRoundTripper gave clientGo to a wrapper above the
	// hook, which may change it in place: this client's requests go through
	// it from then on, as they would without the pool.
	handedOut atomic.Bool
}

func (*clientTransport) pooled() {}

func (c *clientTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.handedOut.Load() {
		return c.clientGo.RoundTrip(req)
	}
	return c.lease.roundTrip(req, c.sameCA, c.clientGo)
}

// sameCA takes the current generation g while it trusts what the client was
// built to trust; after a CA change, requests go through client-go's
// transport, which trusts what client-go alone would.
func (c *clientTransport) sameCA(g *generation) bool {
	if !c.pinCA || g.ca == c.ca {
		return true
	}
	if !c.caMoved.Swap(true) {
		c.lease.countPassThrough()
	}
	return false
}

// CloseIdleConnections closes idle connections of both transports the client
// may use.
func (c *clientTransport) CloseIdleConnections() {
	utilnet.CloseIdleConnectionsFor(c.clientGo)
	utilnet.CloseIdleConnectionsFor(c.lease)
}

// WrappedRoundTripper returns client-go's transport for the client, what a
// wrapper above the hook finds without the pool. The caller may change it
// in place, so this client's requests go through it from then on (counted
// in Stats.PassThrough); the pool's other clients stay on the pool.
func (c *clientTransport) WrappedRoundTripper() http.RoundTripper {
	if !c.handedOut.Swap(true) {
		c.lease.countPassThrough()
	}
	return c.clientGo
}

// CancelRequest stops client-go's cancellation, which unwraps to the first
// round tripper that has the method, here rather than at
// WrappedRoundTripper. Requests on the shared transport end with their
// context.
func (c *clientTransport) CancelRequest(req *http.Request) {
	if cr, ok := c.clientGo.(interface{ CancelRequest(*http.Request) }); ok {
		cr.CancelRequest(req)
	}
}

var _ utilnet.RoundTripperWrapper = &clientTransport{}
