// The hook Wrap installs in a config's WrapTransport, and the copy-safety
// rule it applies to every client built from the config or a copy of it: a
// client rides the shared transport only when client-go's transport for it is
// shown to authenticate, trust, dial, route, negotiate and compress as the
// shared one does.

package sharedtransport

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
	"weak"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
)

// hook is what Wrap installs as the innermost rest.Config.WrapTransport.
// client-go calls it with the transport it built for a client of the wrapped
// config, or of a copy of it (rest.CopyConfig copies WrapTransport), or of the
// config changed in place. The hook never sees the config, only client-go's
// transport, so the rule is: hand a client the shared transport only when
// client-go's transport for that client is shown to authenticate, trust, dial,
// route, negotiate and compress exactly as the shared one does; anything not
// shown keeps client-go's transport (correct, only not shared).
//
// The hook refers to its lease weakly. client-go keeps the WrapTransport of the
// first config of every TLS cache key for as long as it keeps the transport it
// cached for that key (the GetClientCertificate closure of the cached
// transport's tls.Config captures the whole transport.Config), and client-go
// before v0.36 never prunes that cache: a hook holding its lease strongly would
// keep every identity with a client certificate alive for good. Instead the
// wrapped config holds the lease (Wrap attaches it), clients hold it through
// the round tripper the hook returns, and a hook whose lease was collected
// takes a new one.
type hook struct {
	pool *Pool
	id   *identity
	// dial is the dialer of the wrapped config as client-go would use it: a
	// client-go transport that dials with anything else is not this
	// config's.
	dial dialFingerprint
	// onlyHost, set when the wrapped config has a Proxy function, is the
	// host that function was asked about: requests to any other host keep
	// client-go's transport, which asks the client's own Proxy.
	onlyHost string

	mu    sync.Mutex // guards lease
	lease weak.Pointer[lease]
}

func newHook(p *Pool, id *identity, cfg *rest.Config) (*hook, error) {
	h := &hook{pool: p, id: id, dial: defaultDial}
	if cfg.Dial != nil {
		h.dial = fingerprintDial(cfg.Dial)
	}
	if cfg.Proxy != nil {
		probe, err := probeRequest(cfg)
		if err != nil {
			return nil, err
		}
		h.onlyHost = probe.URL.Host
	}
	return h, nil
}

func (h *hook) wrap(rt http.RoundTripper) http.RoundTripper {
	switch rt.(type) {
	case *clientTransport, closedRoundTripper:
		// A hook installed later (the config was wrapped again) already
		// decided for this client.
		return rt
	case *configTransport:
		// TransportFor of a wrapped config: the pool's round tripper, for
		// the identity computed from the config itself.
		return rt
	}
	if isProbe(rt) {
		return rt // Wrap of this config again, finding out what its wrappers do
	}
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
	if l.e.closed.Load() {
		return closedRoundTripper{} // fails every request with ErrClosed, rather than silently leaving the pool
	}
	got := clientGoTransport(rt)
	if got == nil {
		h.pool.stats.passThrough.Add(1)
		return rt // SPDY, websocket, a caller's own transport: never replaced
	}
	g := l.e.current.Load()
	if !sameShape(rt, got, g, h.id, h.dial) {
		h.pool.stats.passThrough.Add(1)
		return rt
	}
	c := &clientTransport{
		lease:     l,
		clientGo:  h.id.withWrapperHeader(rt),
		got:       got,
		dial:      h.dial,
		onlyHost:  h.onlyHost,
		envRoutes: h.id.proxy == nil && routesByEnvironment(got.Proxy),
		built:     time.Now(),
	}
	if !l.e.filesBad.Load() && !l.e.agrees(got, g, h.dial) && isClientGoTransportFor(got, h.id) {
		// client-go's own transport for the identity's files, proven now by
		// asking client-go's cache (which reads the files while they are
		// good), so no later request needs to ask.
		l.e.rememberAgreement(got, g, h.dial)
	}
	// The first request checks the certificate, not the client's
	// construction: client-go starts a refresher for certificate files with
	// every transport it builds, which asks for the certificate at once and,
	// being unlocked where it returns it, must not be asked concurrently.
	return c
}

// withWrapperHeader returns what the config's CONNECT-header wrapper would
// have made of client-go's transport rt had the pool's round tripper not been
// below it (see connectHeaderFor): a clone with the header, when rt is the
// bare *http.Transport such a wrapper clones.
func (id *identity) withWrapperHeader(rt http.RoundTripper) http.RoundTripper {
	t, ok := rt.(*http.Transport)
	if !ok || !id.headerFromWrappers {
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

type closedRoundTripper struct{}

func (closedRoundTripper) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
}

// clientTransport is what one client gets from the hook: the shared transport
// while client-go's transport for that client agrees with it, client-go's
// transport otherwise. Agreement is checked once per generation: a rotation
// changes what the pool presents and never what client-go's transport
// presents, so a client whose credentials matched the old material (a copy
// holding the same bytes inline, in other files) is checked again.
type clientTransport struct {
	lease    *lease
	clientGo http.RoundTripper // what client-go built for this client
	got      *http.Transport   // clientGo unwrapped
	dial     dialFingerprint
	onlyHost string

	// envRoutes: both client-go's transport and the identity's route by the
	// environment (client-go's own proxy function for configs without
	// Proxy), so requests need not ask both where they go.
	envRoutes bool

	state      atomic.Pointer[verdict]
	passedOnce atomic.Bool // counted in Stats.PassThrough
	built      time.Time   // when the hook saw client-go's transport
}

// refresherSettle is how long after client-go built a transport for
// certificate files the pool waits before asking it for its certificate:
// client-go's refresher asks at once when the transport is built and returns
// what it read outside its lock, so the two must not meet.
const refresherSettle = 50 * time.Millisecond

// verdict is a clientTransport's finding about one generation.
type verdict struct {
	g      *generation
	shared bool
	// provisional marks a disagreement found while client-go may still hand
	// out the certificate it read before the files changed (it caches what
	// it reads from certificate files for a second). Such a finding is made
	// again once that window has passed.
	provisional bool
	// expires, when set, ends a finding made by comparing the certificate
	// client-go's transport reads from files the pool does not watch: those
	// files may change without the pool's own material changing.
	expires time.Time
}

func (c *clientTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.onlyHost != "" && req.URL.Host != c.onlyHost {
		return c.clientGo.RoundTrip(req)
	}
	return c.lease.roundTrip(req, c, c.clientGo) // ErrClosed once the pool closed, as for every client
}

// pick returns the generation req may go over, or nil when client-go's
// transport must carry it. It is asked again before a resend: a request held
// until a rotation closed its generation is checked against the new one.
func (c *clientTransport) pick(req *http.Request) *generation {
	v := c.verdict()
	if !v.shared || !c.envRoutes && !sameProxy(c.got.Proxy, v.g.transport.Proxy, req) {
		return nil
	}
	return v.g
}

// verdict returns the finding for the current generation, checking once when
// the generation changed.
func (c *clientTransport) verdict() *verdict {
	e := c.lease.e
	g := e.current.Load()
	v := c.state.Load()
	// While the identity's files fail to load, a finding about a client
	// whose transport reads those very files stands: asking it would read
	// them (see check), and the pool presents their last good material. A
	// transport reading other files is asked as usual.
	if v != nil && v.g == g && (!v.provisional || !e.settled(g)) &&
		(v.expires.IsZero() || time.Now().Before(v.expires) || e.filesBad.Load() && readsFilesOf(c.got, e.id)) {
		return v
	}
	settled := e.settled(g)
	shared, byContent := c.check(g)
	v = &verdict{g: g, shared: shared}
	if shared && byContent {
		v.expires = time.Now().Add(certFileSettle)
	}
	v.provisional = !v.shared && !settled && e.id.certFile != ""
	c.state.Store(v)
	if !v.shared && !v.provisional && c.passedOnce.CompareAndSwap(false, true) {
		e.pool.stats.passThrough.Add(1)
	}
	return v
}

// check reports whether client-go's transport for this client authenticates,
// trusts, dials, negotiates and compresses exactly as g does.
// byContent reports a match made by comparing the certificate of a
// client-go transport that reads it from files, which holds only as long as
// those files do not change.
func (c *clientTransport) check(g *generation) (shared, byContent bool) {
	e := c.lease.e
	if e.agrees(c.got, g, c.dial) {
		// The finding holds for client-go's transport as it was: a
		// wrapper above the hook that unwraps the pool's round tripper
		// may have changed it in place since (see WrappedRoundTripper).
		return sameShape(c.clientGo, c.got, g, e.id, c.dial), false
	}
	fromFiles := readsCertFiles(c.got.TLSClientConfig)
	if (fromFiles || e.id.watchesFiles()) && e.filesBad.Load() {
		// Asking client-go would read files the pool just failed to read
		// (a named pipe, a device, a hung mount), with no bound.
		return false, false
	}
	if fromFiles {
		time.Sleep(time.Until(c.built.Add(refresherSettle)))
		// One look at a time per identity: client-go's certificate-file
		// refresher returns its certificate outside its lock, so concurrent
		// askers race inside client-go.
		e.checkMu.Lock()
		defer e.checkMu.Unlock()
	}
	shared, proven := sameTransport(c.clientGo, c.got, g, e.id, c.dial)
	if !shared {
		return false, false
	}
	if fromFiles && !proven {
		return true, true
	}
	e.rememberAgreement(c.got, g, c.dial)
	return true, false
}

// agreement is a finding that client-go's transport t, for a client that
// dials with dial, agrees with generation g; entry.agreed keeps the latest.
type agreement struct {
	t    weak.Pointer[http.Transport]
	g    *generation
	dial dialFingerprint
}

// agrees reports whether t was already found to agree with g for a client
// that dials with dial.
func (e *entry) agrees(t *http.Transport, g *generation, dial dialFingerprint) bool {
	w := weak.Make(t)
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Contains(e.agreed[:], agreement{w, g, dial})
}

func (e *entry) rememberAgreement(t *http.Transport, g *generation, dial dialFingerprint) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.agreed[e.agreedNext] = agreement{weak.Make(t), g, dial}
	e.agreedNext = (e.agreedNext + 1) % len(e.agreed)
}

// sameTransport compares, field by field, what client-go's transport got does
// with what the generation g does. Material the pool used before g never makes
// a match: a client holding it is not this identity's any more.
// proven reports that got is shown to be the identity's by what it is
// (client-go's cached transport for the identity's files, the exec plugin's
// own authenticator), not by what it presents now.
func sameTransport(rt http.RoundTripper, got *http.Transport, g *generation, id *identity, dial dialFingerprint) (same, proven bool) {
	if !sameShape(rt, got, g, id, dial) {
		return false, false
	}
	gotTLS := got.TLSClientConfig
	if gotTLS == nil {
		return true, true // and so is g's: sameShape compared
	}
	if id.getCert != nil {
		// sameShape found client-go's transport dialing through the exec
		// authenticator's own dialer and asking its own certificate
		// holder: the same authenticator, so the same certificate, now and
		// after the plugin hands out another.
		return true, true
	}
	if isClientGoTransportFor(got, id) {
		// client-go's own transport for the identity's certificate files:
		// it presents what those files hold, as the pool does, even while
		// its cache of them is a second behind the pool's.
		return true, true
	}
	// Roots before the certificate: asking client-go for it is not free.
	gotLeaf, err := clientLeaf(gotTLS)
	if err != nil {
		return false, false
	}
	return bytes.Equal(gotLeaf, g.leaf) && (gotLeaf == nil) == (g.leaf == nil), false
}

// generationALPN is what a client-go transport built when g was must offer:
// g's own list when g speaks HTTP/2 (configured, DISABLE_HTTP2 included, when
// g was built); the list as the config gives it when HTTP/2 was off then; and,
// when g speaks HTTP/1.1 by the pool's choice (keep-alive off), the list
// client-go offers for the identity.
func generationALPN(g *generation, id *identity) []string {
	switch {
	case g.http2:
		return g.transport.TLSClientConfig.NextProtos
	case !g.owner.pool.opts.keepAlive:
		return id.alpn
	}
	return id.nextProtos
}

// sameShape is sameTransport but for the client certificate: everything that
// can be compared without asking client-go's transport for it.
func sameShape(rt http.RoundTripper, got *http.Transport, g *generation, id *identity, dial dialFingerprint) bool {
	// client-go never touches the CONNECT request; the generation's
	// ProxyConnectHeader is the identity's own.
	if got.ProxyConnectHeader != nil {
		return false
	}
	// Every other field (shapeFields: compression, the other dialers,
	// timeouts, limits) is what client-go's transports and g's set alike. A
	// transport of the config's own (cfg.Transport) that sets more keeps it.
	if !sameFields(got, g.transport, shapeFields()) {
		return false
	}
	if fp := fingerprintDial(got.DialContext); !fp.known() || fp != dial {
		return false
	}
	// client-go's certificate-file transports dial through a tracked dialer
	// too, one of their own: only a tracked dialer without them is an exec
	// authenticator's.
	t := execTracker(got.DialContext)
	if id.getCert != nil || t != nil && !readsCertFiles(got.TLSClientConfig) {
		// An exec identity's client-go transports dial through a dialer
		// tracked by the authenticator's connection tracker, one per
		// authenticator: anything else (a copy with a token, its own
		// plugin, inline material) holds other credentials, or the same
		// ones only for now. The same holds the other way: a transport of
		// an exec plugin never matches an identity without that plugin,
		// whatever it presents now, since the plugin may hand out another
		// certificate at any request and a finding holds for a generation.
		if t == nil || t != execTracker(id.dial) {
			return false
		}
	}
	gotTLS, wantTLS := got.TLSClientConfig, g.transport.TLSClientConfig
	if gotTLS == nil || wantTLS == nil {
		return gotTLS == wantTLS
	}
	// client-go's TLS configs set these fields only: no fixed
	// certificates, no verification callbacks, no key log.
	if !onlyFieldsSet(gotTLS) {
		return false
	}
	if !clientGoCertificate(gotTLS, id) {
		// A certificate function of anyone else's (a wrapper inside the
		// hook set it, or a holder of its own handed to client-go) may
		// present another certificate at any handshake; what it presents
		// when asked proves nothing for later.
		return false
	}
	if gotTLS.ServerName != wantTLS.ServerName || gotTLS.InsecureSkipVerify != wantTLS.InsecureSkipVerify ||
		gotTLS.MinVersion != wantTLS.MinVersion || gotTLS.MaxVersion != wantTLS.MaxVersion ||
		!slices.Equal(settledALPN(got), generationALPN(g, id)) || !sameHTTP2(got, g.transport) || !clientGoUpgrades(got) {
		return false
	}
	if file, holder := caFileHolder(rt); holder {
		// Roots client-go re-reads from a file trust alike for good only
		// when the file is the identity's, which the pool reloads sooner;
		// another file with the same roots today may hold others tomorrow.
		return file != "" && file == id.caFile
	}
	return samePool(gotTLS.RootCAs, g.roots)
}

// sameHTTP2 reports whether got speaks HTTP/2 as want does, when want offers
// h2: a protocol list named in the config keeps h2 where DISABLE_HTTP2 left
// HTTP/2 off, so two transports built on either side of a change of the
// variable offer the same list and only one of them speaks what it offers.
func sameHTTP2(got, want *http.Transport) bool {
	return !slices.Contains(want.TLSClientConfig.NextProtos, "h2") || speaksHTTP2(got) == speaksHTTP2(want)
}

// CloseIdleConnections closes idle connections of both transports the client
// may use.
func (c *clientTransport) CloseIdleConnections() {
	utilnet.CloseIdleConnectionsFor(c.clientGo)
	utilnet.CloseIdleConnectionsFor(c.lease)
}

// WrappedRoundTripper is client-go's transport for the client, which the
// shared one was shown to agree with: client-go helpers reading it
// (utilnet.TLSClientConfig, utilnet.DialerFor) see what the client's requests
// get. A wrapper above the hook that unwraps to the *http.Transport and
// clones it to change it (another proxy, dialer or TLS setting) clones what
// it would clone without the pool; the shared transport's own dialer serves
// the pool's connections only, and a clone of it could not dial. One that
// changes it in place is seen by the client's first check (see check).
func (c *clientTransport) WrappedRoundTripper() http.RoundTripper { return c.clientGo }

var _ utilnet.RoundTripperWrapper = &clientTransport{}

// clientLeaf returns the DER of the client certificate c presents, or nil.
func clientLeaf(c *tls.Config) ([]byte, error) {
	if c.GetClientCertificate == nil {
		return nil, nil
	}
	cert, err := c.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil || cert == nil || len(cert.Certificate) == 0 {
		return nil, err
	}
	return cert.Certificate[0], nil
}

func samePool(a, b *x509.CertPool) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

func sameProxy(got, want func(*http.Request) (*url.URL, error), req *http.Request) bool {
	if got == nil || want == nil {
		return (got == nil) == (want == nil)
	}
	g, err1 := got(req)
	w, err2 := want(req)
	return err1 == nil && err2 == nil && sameURL(g, w)
}

func sameURL(a, b *url.URL) bool {
	if a == nil || b == nil || a == b {
		return a == b
	}
	return a.Scheme == b.Scheme && a.Host == b.Host && a.Opaque == b.Opaque && a.Path == b.Path &&
		a.RawQuery == b.RawQuery && (a.User == b.User || a.User != nil && b.User != nil && a.User.String() == b.User.String())
}

// onlyFieldsSet reports whether c sets no exported field but those client-go
// sets on the TLS configs it builds.
func onlyFieldsSet(c *tls.Config) bool {
	v := reflect.ValueOf(c).Elem()
	for _, i := range clientGoTLSUnset() {
		if !v.Field(i).IsZero() {
			return false
		}
	}
	return true
}

// The fields compared, as indices computed once: reflect's StructField
// allocates, and the hook compares for every client it sees.
var (
	// shapeFields: every field of a transport but the proxy (asked per
	// request), the dialer and TLS (compared on their own), keep-alive (the
	// pool's option), the CONNECT header (the identity's own) and the
	// protocol fields net/http writes at a transport's first use.
	shapeFields = sync.OnceValue(func() []int {
		return exportedFieldsBut(reflect.TypeFor[http.Transport](), "Proxy", "DialContext", "TLSClientConfig",
			"DisableKeepAlives", "ProxyConnectHeader", "TLSNextProto", "Protocols", "HTTP2")
	})
	clientGoTLSUnset = sync.OnceValue(func() []int {
		return exportedFieldsBut(reflect.TypeFor[tls.Config](), "RootCAs", "ServerName", "InsecureSkipVerify",
			"MinVersion", "MaxVersion", "NextProtos", "GetClientCertificate")
	})
)

func exportedFieldsBut(t reflect.Type, skip ...string) []int {
	var fields []int
	for i := range t.NumField() {
		if f := t.Field(i); f.IsExported() && !slices.Contains(skip, f.Name) {
			fields = append(fields, i)
		}
	}
	return fields
}

// sameFields compares the given fields of two transports. Functions, maps
// and pointers are the same when they are the same value (one func value,
// one map, one pointee); everything else by value.
func sameFields(a, b *http.Transport, fields []int) bool {
	va, vb := reflect.ValueOf(a).Elem(), reflect.ValueOf(b).Elem()
	for _, i := range fields {
		fa, fb := va.Field(i), vb.Field(i)
		switch fa.Kind() {
		case reflect.Func:
			if *(*unsafe.Pointer)(unsafe.Pointer(fa.UnsafeAddr())) != *(*unsafe.Pointer)(unsafe.Pointer(fb.UnsafeAddr())) {
				return false
			}
		case reflect.Map, reflect.Pointer, reflect.Slice, reflect.Chan:
			if fa.Pointer() != fb.Pointer() || fa.Kind() == reflect.Slice && fa.Len() != fb.Len() {
				return false
			}
		default:
			if !fa.Equal(fb) {
				return false
			}
		}
	}
	return true
}

// canonicalHeader encodes h so that equal headers give equal bytes.
func canonicalHeader(h http.Header) []byte {
	if len(h) == 0 {
		return nil
	}
	var b []byte
	for _, k := range slices.Sorted(maps.Keys(h)) {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(h[k])))
		for _, v := range h[k] {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return b
}
