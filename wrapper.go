// The hook Wrap installs in a config's WrapTransport, and the rule it applies
// to every client built from the config or a copy of it: a client rides the
// shared transport only when data the pool was given, or objects it created
// itself, show that client-go's transport for it authenticates, trusts,
// dials, routes, negotiates and compresses as the shared one does.

package sharedtransport

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/apimachinery/third_party/forked/golang/netutil"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// certRecheck is how long a client's certificate, once found to be the
// identity's, is taken to stay so: client-go re-reads certificate files as
// often.
const certRecheck = 5 * time.Minute

// hook is what Wrap installs as the innermost rest.Config.WrapTransport.
// client-go calls it with the transport it built for a client of the wrapped
// config, of a copy of it (rest.CopyConfig copies WrapTransport), or of the
// config changed in place. It sees only that transport, never the config, and
// decides in one of two ways:
//
//   - For a config client-go caches (no Proxy, no Dial), client-go's own cache
//     key decides: a client whose transport is the one client-go's cache
//     holds for the wrapped config agrees with it on every field of the key.
//   - For a config client-go does not cache, Wrap installs a dialer of the
//     pool's (poolDialer): a transport that dials through it, the identity's
//     first hop unchanged, is a client of the wrapped config or of a copy
//     that kept its dialer. Its TLS settings are compared field by field, its
//     proxy is asked with each real request, and its certificate is asked for
//     at the client's first request. The dialer and the certificate are
//     questions to functions, the part of the rule not yet met: Go cannot
//     compare functions, and client-go hands the hook nothing else.
//
// The hook refers to its lease weakly: client-go before v0.36 keeps the
// WrapTransport of the first config of each cache key for good (the cached
// transport's certificate callback captures it), so a hook holding its lease
// would keep the identity alive for good. The wrapped config holds the lease
// (Wrap attaches it), clients hold it through their round tripper, and a hook
// whose lease was collected takes a new one.
type hook struct {
	pool *Pool
	id   *identity
	// base is the transport config of the wrapped config as Wrap found it,
	// for asking client-go's cache which transport it holds for the
	// config's key; nil when the config carries dialer instead.
	base   *transport.Config
	dialer *poolDialer
	// firstHop is the address the identity's transport dials for the
	// wrapped config's host: its proxy's, or the server's.
	firstHop string
	// onlyHost, set when the wrapped config has a Proxy function, is the
	// host that function was asked about: requests to other hosts keep
	// client-go's transport, which asks the client's own function.
	onlyHost string

	mu        sync.Mutex // guards lease, cached and cachedFor
	lease     weak.Pointer[lease]
	cached    http.RoundTripper // client-go's cached transport for base
	cachedFor *generation       // the generation current when cached was asked for
}

// newHook prepares the hook for cfg, whose identity is s.id and transport g.
// For a config client-go does not cache it installs the pool's dialer in cfg.
func (p *Pool) newHook(s sharing, cfg *rest.Config, g *generation) (*hook, error) {
	h := &hook{pool: p, id: s.id, onlyHost: s.onlyHost}
	if cfg.Proxy == nil && cfg.Dial == nil {
		h.base = s.tc
		rt, err := clientGoTransport(h.base)
		if err != nil {
			return nil, fmt.Errorf("sharedtransport: %w", err)
		}
		h.cached = rt
		return h, nil
	}
	h.dialer = &poolDialer{dial: cfg.Dial}
	cfg.Dial = h.dialer.DialContext
	h.firstHop = firstHop(g.transport, s.host)
	return h, nil
}

// firstHop returns the address t dials for req: its proxy's, or req's
// host's. The shared transport's proxy is the config's route, or the
// environment's as client-go reads it.
func firstHop(t *http.Transport, req *http.Request) string {
	if t.Proxy != nil {
		if u, err := t.Proxy(req); err == nil && u != nil {
			return netutil.CanonicalAddr(u)
		}
	}
	return netutil.CanonicalAddr(req.URL)
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
		h.pool.opts.logger.Error(err, "Config left to client-go's own transport")
		h.pool.stats.passThrough.Add(1)
		return rt
	}
	if l.e.closed.Load() {
		return closedRoundTripper{}
	}
	got := unwrapTransport(rt)
	if got == nil || !h.agrees(rt, got, l.e) {
		h.pool.stats.passThrough.Add(1)
		return rt // SPDY, websocket, a caller's own transport, another identity
	}
	return &clientTransport{
		lease:     l,
		clientGo:  h.id.withWrapperHeader(rt),
		got:       got,
		onlyHost:  h.onlyHost,
		checkCert: h.base == nil,
	}
}

// agrees reports whether rt, client-go's transport for a client, connects as
// the entry's current generation does, but for the client certificate of a
// config client-go does not cache (asked at the client's first request).
func (h *hook) agrees(rt http.RoundTripper, got *http.Transport, e *entry) bool {
	g := e.current.Load()
	if h.base == nil {
		return dialerOf(got.DialContext, h.firstHop) == h.dialer && sameConnection(got, g, h.id)
	}
	h.mu.Lock()
	cached, asked := h.cached, h.cachedFor == g
	h.mu.Unlock()
	if rt == cached {
		return true
	}
	if asked || e.filesBad.Load() {
		// While the pool rejects the files, client-go's answer for them is
		// not the material the pool serves: the client keeps client-go's
		// transport, and meets the files as it would without the pool.
		return false
	}
	// A rotation may have changed the key client-go computes from the files
	// (client-go before v0.36 keys its cache by the CA's bytes): ask again
	// once per generation, without the lock (client-go reads the files).
	now, err := clientGoTransport(h.base)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cachedFor != g {
		h.cachedFor = g
		if err == nil {
			h.cached = now
		}
	}
	return rt == h.cached
}

// withWrapperHeader returns what the config's declared CONNECT-header
// wrapper (WrapDeclared) would have made of client-go's transport rt had
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
func (h *hook) current() (*lease, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if l := h.lease.Value(); l != nil {
		return l, nil
	}
	l, err := h.pool.acquire(h.id)
	if err != nil {
		return nil, err
	}
	h.lease = weak.Make(l)
	return l, nil
}

// unwrapTransport returns the *http.Transport under rt's wrappers, or nil.
func unwrapTransport(rt http.RoundTripper) *http.Transport {
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

type closedRoundTripper struct{}

func (closedRoundTripper) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
}

// poolDialer is the dialer Wrap installs in a config client-go does not
// cache. It dials as the config's own Dial would, or as client-go's default
// dialer, so every other user of the config (SPDY executors, copies,
// rest.AnonymousClientConfig) behaves as before; only the pool can ask it
// who it is (dialerOf).
type poolDialer struct {
	dial func(ctx context.Context, network, address string) (net.Conn, error) // nil: client-go's default
}

var clientGoDialer = &net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}

// dialerQuestion is what dialerOf puts in the context of the dial it asks
// for; a poolDialer answers by writing itself into it, when the address
// reached it as asked.
type dialerQuestion struct {
	addr   string
	answer *poolDialer
}

type dialerQuestionKey struct{}

var errDialerQuestion = errors.New("sharedtransport: a question to the pool's dialer, not a dial")

func (d *poolDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if q, ok := ctx.Value(dialerQuestionKey{}).(*dialerQuestion); ok {
		if network == "tcp" && address == q.addr {
			q.answer = d
		}
		return nil, errDialerQuestion
	}
	if d.dial != nil {
		return d.dial(ctx, network, address)
	}
	return clientGoDialer.DialContext(ctx, network, address)
}

// dialerOf returns the pool's dialer that dial is, or passes addr to
// unchanged, or nil. addr is the first hop the identity's transport dials
// (its proxy, or the server), so a dialer that sends that hop elsewhere
// before calling the pool's is not taken for it. It asks with a context
// that is already cancelled, so a dialer of anyone else's returns an error
// without connecting.
func dialerOf(dial func(ctx context.Context, network, address string) (net.Conn, error), addr string) *poolDialer {
	if dial == nil {
		return nil
	}
	q := &dialerQuestion{addr: addr}
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), dialerQuestionKey{}, q))
	cancel()
	if conn, err := dial(ctx, "tcp", addr); err == nil {
		conn.Close()
	}
	return q.answer
}

// sameConnection reports whether got, client-go's transport for a client
// that dials through the pool's dialer, sets up connections as g does: the
// same TLS settings, compression and no CONNECT header or dialer of its own.
func sameConnection(got *http.Transport, g *generation, id *identity) bool {
	if got.Dial != nil || got.DialTLS != nil || got.DialTLSContext != nil || got.ProxyConnectHeader != nil ||
		got.GetProxyConnectHeader != nil || got.OnProxyConnectResponse != nil || got.DisableCompression != id.key.disableCompression {
		return false
	}
	have, want := got.TLSClientConfig, g.transport.TLSClientConfig
	if have == nil || want == nil {
		return have == nil && want == nil
	}
	return onlyClientGoFields(have) && have.ServerName == want.ServerName &&
		have.InsecureSkipVerify == want.InsecureSkipVerify && have.MinVersion == want.MinVersion &&
		have.MaxVersion == want.MaxVersion && slices.Equal(settledALPN(got), id.alpn) && speaksHTTP2(got) == id.http2 &&
		samePool(have.RootCAs, g.roots) && (have.GetClientCertificate != nil) == id.presentsCert()
}

// presentsCert reports whether the identity's connections present a client
// certificate (or ask an exec plugin for one).
func (id *identity) presentsCert() bool {
	return id.key.getCert != nil || id.key.certFile != "" || len(id.certData) > 0 && len(id.keyData) > 0
}

// clientGoTLSFields are the fields of the TLS configurations client-go
// builds; a configuration that sets any other exported field was changed by
// someone else and is not shown alike.
var clientGoTLSFields = []string{"RootCAs", "ServerName", "InsecureSkipVerify", "MinVersion", "MaxVersion",
	"NextProtos", "GetClientCertificate"}

// onlyClientGoFields reports whether c sets no exported field client-go
// leaves unset.
func onlyClientGoFields(c *tls.Config) bool { return tlsFieldBeyond(c, clientGoTLSFields) == "" }

// tlsFieldBeyond returns the name of the first exported field of c that is
// set and not in allowed, or "".
func tlsFieldBeyond(c *tls.Config, allowed []string) string {
	v := reflect.ValueOf(c).Elem()
	t := v.Type()
	for i := range t.NumField() {
		if f := t.Field(i); f.IsExported() && !slices.Contains(allowed, f.Name) && !v.Field(i).IsZero() {
			return f.Name
		}
	}
	return ""
}

// clientTransport is what one client gets from the hook: the shared transport
// while client-go's transport for the client agrees with it, client-go's
// transport otherwise.
type clientTransport struct {
	lease    *lease
	clientGo http.RoundTripper // what client-go built for this client
	got      *http.Transport   // clientGo unwrapped
	onlyHost string
	// checkCert: the client's certificate is asked for at its first request
	// on each generation and at least every certRecheck (a config client-go
	// does not cache); its proxy is asked per request.
	checkCert bool

	checkMu    sync.Mutex // one check at a time for this client; guards no field
	verdict    atomic.Pointer[certVerdict]
	passedOnce atomic.Bool // counted in Stats.PassThrough
	// handedOut: WrappedRoundTripper gave clientGo to a wrapper above the
	// hook, which may change it in place; every request goes through it
	// from then on, as it would without the pool.
	handedOut atomic.Bool
}

// certVerdict is a finding about a client's certificate for one generation.
// A final one is never looked at again.
type certVerdict struct {
	g       *generation
	same    bool
	final   bool
	expires time.Time
}

// holds reports whether v still decides for generation g at now.
func (v *certVerdict) holds(g *generation, now time.Time) bool {
	return v != nil && (v.final || v.g == g && now.Before(v.expires))
}

func (c *clientTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.handedOut.Load() {
		return c.clientGo.RoundTrip(req)
	}
	if c.onlyHost != "" && req.URL.Host != c.onlyHost {
		return c.clientGo.RoundTrip(req)
	}
	return c.lease.roundTrip(req, c, c.clientGo)
}

// pick returns the generation req goes over, or nil when client-go's
// transport carries it.
func (c *clientTransport) pick(req *http.Request) *generation {
	g := c.lease.e.current.Load()
	if c.checkCert && (!c.sameCert(g) || !sameProxy(c.got.Proxy, g.transport.Proxy, req)) {
		c.passThrough()
		return nil
	}
	return g
}

// passThrough counts the client in Stats.PassThrough, once.
func (c *clientTransport) passThrough() {
	if c.passedOnce.CompareAndSwap(false, true) {
		c.lease.e.pool.stats.passThrough.Add(1)
	}
}

// sameCert reports whether the client presents the certificate g presents,
// asking client-go's transport for it once per generation and certRecheck.
func (c *clientTransport) sameCert(g *generation) bool {
	if v := c.verdict.Load(); v.holds(g, time.Now()) {
		return v.same
	}
	c.checkMu.Lock()
	defer c.checkMu.Unlock()
	now := time.Now()
	v := c.verdict.Load()
	switch {
	case v.holds(g, now):
		return v.same
	case v != nil && c.lease.e.id.key.certFile != "":
		// client-go's certificate-file callback returns its cache after
		// unlocking it: a caller that loads changed files then writes what
		// another goroutine read unlocked. A client of a files identity is
		// asked again only on the generation it was asked on; after a
		// rotation it keeps client-go's transport for good (checkMu orders
		// its earlier question before the handshakes that transport makes).
		v = &certVerdict{g: g, same: v.same && v.g == g, final: v.g != g || !v.same}
		if !v.final {
			v.same, v.expires = c.certMatches(g), now.Add(certRecheck)
			v.final = !v.same
		}
	default:
		v = &certVerdict{g: g, same: c.certMatches(g), expires: now.Add(certRecheck)}
		v.final = !v.same && c.lease.e.id.key.certFile != ""
	}
	c.verdict.Store(v)
	return v.same
}

// certMatches asks the client's TLS configuration for its certificate and
// compares it, the whole chain, with what g presents.
func (c *clientTransport) certMatches(g *generation) bool {
	tc := c.got.TLSClientConfig
	if tc == nil || tc.GetClientCertificate == nil {
		return !c.lease.e.id.presentsCert()
	}
	have, err := chainOf(tc.GetClientCertificate(&tls.CertificateRequestInfo{}))
	if err != nil || have == nil {
		return false
	}
	want := g.chain
	if holder := c.lease.e.id.key.getCert; holder != nil {
		if want, err = chainOf(holder.GetCert()); err != nil {
			return false
		}
	}
	return slices.EqualFunc(have, want, bytes.Equal)
}

func chainOf(cert *tls.Certificate, err error) ([][]byte, error) {
	if err != nil || cert == nil || len(cert.Certificate) == 0 {
		return nil, err
	}
	return cert.Certificate, nil
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
// Stats.PassThrough.
func (c *clientTransport) WrappedRoundTripper() http.RoundTripper {
	if !c.handedOut.Swap(true) {
		c.passThrough()
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

func samePool(a, b *x509.CertPool) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// sameProxy reports whether two proxy functions send req the same way.
func sameProxy(got, want func(*http.Request) (*url.URL, error), req *http.Request) bool {
	if got == nil || want == nil {
		return (got == nil) == (want == nil)
	}
	g, err1 := got(req)
	w, err2 := want(req)
	return err1 == nil && err2 == nil && sameURL(g, w)
}

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
