// The hook Wrap installs in a config's WrapTransport, and the rule it applies
// to every client built from the config or a copy of it: a client rides the
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
	"k8s.io/client-go/transport"
)

// hook is what Wrap installs as the innermost rest.Config.WrapTransport of a
// config client-go caches (no Proxy, no Dial). client-go calls it with the
// transport it built for a client of the wrapped config, of a copy of it
// (rest.CopyConfig copies WrapTransport), or of the config changed in place.
// It sees only that transport, never the config, and client-go's own cache
// decides: a client whose transport is the one client-go's cache holds for
// the wrapped config agrees with it on every field of client-go's key, which
// covers everything that reaches the connection. Any other transport (a copy
// with another certificate, a Proxy or Dial added, SPDY) passes through.
//
// Every field of the pool's identity is one client-go's key holds the same
// way, so a match with client-go's cached transport proves it, except the
// CA of a watched file:
//
//	identity (identity.go)      client-go's key (transport/cache.go)
//	insecure, serverName,       the same fields
//	nextProtos, compression
//	certFile, keyFile           the paths, when both are files without data
//	certData, keyData           the bytes otherwise (here: their digests)
//	getCert                     the same *GetCertHolder
//	caData                      the bytes
//	caFile, watched             the path from v0.36 with ClientsAllowCARotation;
//	                            before, or with the gate off, the bytes read
//	proxy, dialName             never reach a hook: Wrap passes them through
//	connectHeader               declared by the caller, not client-go's
//
// Where client-go keys a watched CA file by its bytes (caFileByPath false),
// a copy carrying those bytes inline, or in another file, is handed the
// wrapped config's cached transport, and must never follow the file it
// does not name. There the CA is checked by data: a client rides the
// shared transport only when client-go's transport for it trusts exactly
// the roots the shared one trusts (trustsAlike), and only while the
// identity's CA stays what it was then (clientTransport.pick).
//
// The hook refers to its lease weakly: client-go before v0.36 keeps the
// WrapTransport of the first config of each cache key for good (the cached
// transport's certificate callback captures it), so a hook holding its lease
// would keep the identity alive for good. The wrapped config holds the lease
// (Wrap attaches it), clients hold it through their round tripper, and a hook
// whose lease was collected takes a new one.
type hook struct {
	reg *registry
	id  *identity
	// base is the transport config of the wrapped config as Wrap found it,
	// for asking client-go's cache which transport it holds for the
	// config's key.
	base *transport.Config

	mu    sync.Mutex // guards lease and askedFor
	lease weak.Pointer[lease]
	// askedFor is the generation current when the hook asked client-go
	// which transport its cache holds for base (the answer is the entry's,
	// see entry.clientGo); weak, so the hook, which client-go may keep for
	// good, keeps no generation.
	askedFor weak.Pointer[generation]
}

// newHook prepares the hook for a config whose identity and transport config
// are s.id and s.tc, holding l weakly, and asks client-go for its transport
// as the identity's generation now holds, unless a config of the identity
// asked while that generation was current: a config per request would have
// client-go read the files once more for every config. r is where the hook
// takes a new lease once l is collected.
func newHook(r *registry, s sharing, l *lease) (*hook, error) {
	h := &hook{reg: r, id: s.id, base: s.tc, lease: weak.Make(l)}
	e := l.e
	wg := weak.Make(e.current.Load())
	if e.clientGoFound(wg, nil) {
		return h, nil
	}
	rt, err := clientGoTransport(s.tc)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: %w", err)
	}
	e.rememberClientGo(wg, rt)
	h.askedFor = wg
	return h, nil
}

// clientGoTransport returns the transport client-go builds (or takes from
// its cache) for tc, as it hands it to WrapTransport: what client-go's own
// stack for the config rests on. The per-request layers above it (user
// agent, credentials, impersonation) are not built; they are not part of
// client-go's cache key either.
func clientGoTransport(tc *transport.Config) (http.RoundTripper, error) {
	var base http.RoundTripper
	c := *tc
	c.UserAgent, c.Username, c.Password, c.BearerToken, c.BearerTokenFile = "", "", "", "", ""
	c.Impersonate = transport.ImpersonationConfig{}
	c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		base = rt
		return rt
	}
	if _, err := transport.New(&c); err != nil {
		return nil, err
	}
	return base, nil
}

func (h *hook) wrap(rt http.RoundTripper) http.RoundTripper {
	switch rt.(type) {
	case *clientTransport, *configTransport, closedRoundTripper:
		return rt // a hook installed later, or TransportFor, already decided
	}
	l, err := h.current()
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
	g, ok := h.agrees(rt, l.e)
	pinCA := h.id.key.caFile != "" && !caFileByPath()
	bottom := unwrapToTransport(rt)
	if !ok || pinCA && !trustsAlike(rt, g.conns.Shared().TLSClientConfig) || h.reg.handedOut.has(bottom) {
		h.reg.stats.passThrough.Add(1)
		return rt // SPDY, websocket, a caller's own transport, another identity
	}
	c := &clientTransport{lease: l, pinCA: pinCA, ca: g.ca, clientGo: h.id.withWrapperHeader(rt)}
	if c.clientGo == rt {
		c.cachedBottom = bottom
	}
	return c
}

// caFileByPath reports whether client-go keys a CA file named without data
// by its path, as it does from v0.36 while its ClientsAllowCARotation gate
// is on (the default). Before v0.36 the gate is not registered, Enabled
// panics, and client-go keys the file by the bytes it read.
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

// agrees reports whether rt is a transport client-go's cache holds now for
// the wrapped config or another wrapped config of the identity. What client-go was asked holds for the generation
// current when it was asked: after a rotation it is asked again before any
// client is compared with it, since client-go (before v0.36) keys its cache
// by the CA's bytes, and a copy with the old bytes inline would otherwise
// match the transport it held for the files before.
// It returns the generation it found current.
func (h *hook) agrees(rt http.RoundTripper, e *entry) (*generation, bool) {
	if e.files.bad() {
		// While the pool rejects the files, a client built now does not
		// ride the material the pool kept: it keeps client-go's transport,
		// and meets the files as it would without the pool.
		return nil, false
	}
	cur := e.current.Load()
	g := weak.Make(cur)
	if e.clientGoFound(g, rt) {
		return cur, true
	}
	h.mu.Lock()
	asked := h.askedFor == g
	h.mu.Unlock()
	if !asked {
		// Asked without the lock: client-go reads the files. The answer is
		// recorded before askedFor, so a concurrent call that sees askedFor
		// set finds it below.
		if now, err := clientGoTransport(h.base); err == nil {
			e.rememberClientGo(g, now)
		}
		h.mu.Lock()
		h.askedFor = g
		h.mu.Unlock()
	}
	return cur, e.clientGoFound(g, rt)
}

// clientGoFound reports whether a hook of e's configs found, while g was
// current, that client-go's cache holds rt for its config; for a nil rt,
// whether one found any.
func (e *entry) clientGoFound(g weak.Pointer[generation], rt http.RoundTripper) bool {
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

// rememberClientGo records that client-go's cache holds rt for a config of
// e while g is current, so that the hooks of e's other configs (a config
// per request) need not ask client-go, which reads the files, again.
func (e *entry) rememberClientGo(g weak.Pointer[generation], rt http.RoundTripper) {
	e.clientGoMu.Lock()
	defer e.clientGoMu.Unlock()
	if e.clientGoFor != g {
		e.clientGoFor, e.clientGo = g, nil
	}
	if !slices.Contains(e.clientGo, rt) {
		e.clientGo = append(e.clientGo, rt)
	}
}

// withWrapperHeader returns what the config's declared CONNECT-header
// wrapper (WithProxyConnectHeader) would have made of client-go's transport rt had
// the pool's round tripper not been below it: a clone with the header, when
// rt is the bare *http.Transport such a wrapper clones.
func (id *identity) withWrapperHeader(rt http.RoundTripper) http.RoundTripper {
	t, ok := rt.(*http.Transport)
	if !ok || len(id.connectHeader) == 0 {
		return rt
	}
	t = t.Clone()
	t.ProxyConnectHeader = id.connectHeader.Clone()
	return t
}

// current returns the hook's lease, taking a new one when it was collected.
// The lock is not held while the lease is taken, which may read the
// identity's files: a client built meanwhile takes one too, and the lease
// kept is the first one stored (the other is collected and released).
func (h *hook) current() (*lease, error) {
	h.mu.Lock()
	l := h.lease.Value()
	h.mu.Unlock()
	if l != nil {
		return l, nil
	}
	l, err := h.reg.acquire(h.id)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if kept := h.lease.Value(); kept != nil {
		return kept, nil
	}
	h.lease = weak.Make(l)
	return l, nil
}

type closedRoundTripper struct{}

func (closedRoundTripper) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
}

// clientTransport is what one client gets from the hook: the shared
// transport, until a wrapper above the hook asks for the transport below it.
type clientTransport struct {
	lease    *lease
	clientGo http.RoundTripper // what client-go built for this client
	// pinCA: client-go keys the identity's CA file by its bytes, so the
	// client rides the shared transport only while the identity's CA is ca,
	// the digest of the CA it had when the client was built, which
	// client-go's transport for it was found to trust.
	pinCA bool
	ca    digest
	// caMoved: the identity's CA has changed since; the client sends
	// through clientGo (counted once in Stats.PassThrough).
	caMoved atomic.Bool
	// cachedBottom, set when clientGo is client-go's cached transport
	// itself (which every client of its cache key uses without the pool),
	// is the *http.Transport under it, found when the client was built so
	// that requests need not unwrap it.
	cachedBottom *http.Transport
	// handedOut: WrappedRoundTripper gave clientGo to a wrapper above the
	// hook, which may change it in place; every request goes through it
	// from then on, as it would without the pool. When clientGo is
	// client-go's cached transport, the same holds for every client that
	// has it (handedOutTransports).
	handedOut atomic.Bool
}

func (c *clientTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.handedOut.Load() || c.cachedBottom != nil && c.lease.e.env.handedOut.has(c.cachedBottom) {
		return c.clientGo.RoundTrip(req)
	}
	return c.lease.roundTrip(req, c, c.clientGo)
}

// pick sends req over the identity's current generation while that trusts
// what the client was built to trust; after a CA change, through
// client-go's transport, which trusts what client-go alone would (the
// CA it was given, or, from v0.36, the file it names, re-read by
// client-go on its own schedule).
func (c *clientTransport) pick(*http.Request) *generation {
	g := c.lease.e.current.Load()
	if !c.pinCA || g.ca == c.ca {
		return g
	}
	if !c.caMoved.Swap(true) {
		c.lease.e.env.stats.passThrough.Add(1)
	}
	return nil
}

// CloseIdleConnections closes idle connections of both transports the client
// may use.
func (c *clientTransport) CloseIdleConnections() {
	utilnet.CloseIdleConnectionsFor(c.clientGo)
	utilnet.CloseIdleConnectionsFor(c.lease)
}

// WrappedRoundTripper returns client-go's transport for the client, what a
// wrapper above the hook would find without the pool. The pool cannot see
// what the caller does with it (change it in place, send through it), so the
// client's requests go through it from then on and the client counts in
// Stats.PassThrough; when it is client-go's cached transport, so do the
// requests of every client that has it, as they would without the pool.
func (c *clientTransport) WrappedRoundTripper() http.RoundTripper {
	p := c.lease.e.env
	if c.cachedBottom != nil {
		p.handedOut.add(c.cachedBottom)
	}
	if !c.handedOut.Swap(true) {
		p.stats.passThrough.Add(1)
	}
	return c.clientGo
}

// CancelRequest is here so that client-go's round trippers, which cancel by
// unwrapping to the first round tripper that has it (http.Client.Timeout),
// stop here instead of calling WrappedRoundTripper. It reaches client-go's
// transport, where the client's passed-through requests go; the shared
// transport's requests end with their context, which net/http cancels too.
func (c *clientTransport) CancelRequest(req *http.Request) {
	if cr, ok := c.clientGo.(interface{ CancelRequest(*http.Request) }); ok {
		cr.CancelRequest(req)
	}
}

var _ utilnet.RoundTripperWrapper = &clientTransport{}
