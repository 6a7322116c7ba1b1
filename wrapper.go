// The hook Wrap installs in a config's WrapTransport, and the copy-safety
// rule it applies to every client built from the config or a copy of it: a
// client rides the shared transport only when client-go's transport for it is
// shown to authenticate, trust, dial, route, negotiate and compress as the
// shared one does.

package sharedtransport

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
	"weak"

	"golang.org/x/net/http2"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
	"k8s.io/client-go/util/connrotation"
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

// readsCertFiles reports whether c's client certificate comes from client-go's
// certificate-file reloader, which re-reads files the pool may not watch.
func readsCertFiles(c *tls.Config) bool {
	if c == nil || c.GetClientCertificate == nil {
		return false
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	return fn == nil || strings.Contains(fn.Name(), "dynamicClientCert")
}

// readsFilesOf reports whether got's client certificate comes from client-go's
// certificate-file reloader reading id's certificate and key files. The
// reloader (client-go's dynamicClientCert, a type the pool cannot name) keeps
// the function reading the files just before the connrotation dialer got
// dials with; that function is transport.TLSConfigFor's, whose config names
// the files.
func readsFilesOf(got *http.Transport, id *identity) bool {
	c := got.TLSClientConfig
	if id.certFile == "" || c == nil || c.GetClientCertificate == nil || !dialInspection() ||
		reflect.ValueOf(got.DialContext).Pointer() != rotDialerCode {
		return false
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	if fn == nil || fn.Name() != "k8s.io/client-go/transport.(*dynamicClientCert).GetClientCertificate-fm" {
		return false
	}
	reloader := certClosureWord(c.GetClientCertificate, 1) // the method value's receiver
	dialer := uintptr(unsafe.Pointer(receiverOf[connrotation.Dialer](got.DialContext)))
	word := unsafe.Sizeof(uintptr(0))
	for i := uintptr(1); i < maxReloaderWords; i++ {
		// Words are compared as integers: some of the reloader's (its
		// mutex) are not pointers, and must not be loaded as one.
		if *(*uintptr)(unsafe.Add(reloader, i*word)) != dialer {
			continue
		}
		// The word before the dialer is the function reading the files in
		// every client-go this was checked against (v0.31 to v0.37). A word
		// that cannot be a function value (zero, in the never-mapped first
		// page, unaligned) ends the look before it is read as one.
		if w := *(*uintptr)(unsafe.Add(reloader, (i-1)*word)); w < 1<<12 || w%word != 0 {
			return false
		}
		_, _, cfg, ok := tlsConfigForCaptures(*(*certFunc)(unsafe.Add(reloader, (i-1)*word)))
		if !ok || !cfg.TLS.ReloadTLSFiles {
			return false
		}
		cert, err1 := filepath.Abs(cfg.TLS.CertFile)
		key, err2 := filepath.Abs(cfg.TLS.KeyFile)
		return err1 == nil && err2 == nil && cert == id.certFile && key == id.keyFile
	}
	return false
}

// maxReloaderWords bounds the search for the dialer in client-go's
// certificate-file reloader: it lies within its first words (the sixth in
// client-go v0.31, the ninth in v0.37).
const maxReloaderWords = 12

// clientGoCertificate reports whether c's client certificate, if any, is
// shown to be what client-go presents for a config of id: its certificate-file
// reloader, its static certificate (inline data: fixed for good, so what it
// presents when compared it presents later) for an identity without an exec
// plugin, or id's exec plugin's own certificate holder. transport.TLSConfigFor
// hands out one function for the last two and for any GetCertHolder a caller
// gives it (a wrapper inside the hook, a transport of the config's own), so
// the function's name is not enough: what it captured tells which.
func clientGoCertificate(c *tls.Config, id *identity) bool {
	if c.GetClientCertificate == nil {
		return true
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	if fn == nil || !strings.HasPrefix(fn.Name(), "k8s.io/client-go/transport.") {
		return false
	}
	if readsCertFiles(c) {
		return true
	}
	static, loader, cfg, ok := tlsConfigForCaptures(c.GetClientCertificate)
	switch {
	case !ok || loader:
		return false
	case id.getCert == nil:
		return static
	}
	return !static && cfg.TLS.GetCertHolder == id.getCert
}

// tlsConfigForCaptures reads what the certificate function f, when it is
// transport.TLSConfigFor's, captured: whether it has a static certificate
// (which it presents whatever else it has), a certificate-file loader, and
// the transport.Config whose GetCertHolder it asks otherwise. ok is false for
// any other function, or when the closure's layout is not as
// certClosureLayout found it.
func tlsConfigForCaptures(f certFunc) (static, loader bool, cfg *transport.Config, ok bool) {
	l := certClosureLayout()
	if !l.ok || reflect.ValueOf(f).Pointer() != l.code {
		return false, false, nil, false
	}
	cfg = (*transport.Config)(certClosureWord(f, l.config))
	return certClosureWord(f, l.static) != nil, certClosureWord(f, l.loader) != nil, cfg, cfg != nil
}

type certFunc = func(*tls.CertificateRequestInfo) (*tls.Certificate, error)

// certClosureWord returns word i of f's closure record: the code pointer, then
// what f captured (see closureOf).
func certClosureWord(f certFunc, i int) unsafe.Pointer {
	rec := *(*unsafe.Pointer)(unsafe.Pointer(&f))
	return *(*unsafe.Pointer)(unsafe.Add(rec, uintptr(i)*unsafe.Sizeof(uintptr(0))))
}

type certClosure struct {
	ok                     bool
	code                   uintptr // TLSConfigFor's certificate function
	static, loader, config int     // the words of its closure record holding each capture
}

// certClosureCaptures is how many variables transport.TLSConfigFor's
// certificate function captures: the static certificate, the file loader and
// the config.
const certClosureCaptures = 3

// certClosureLayout finds where transport.TLSConfigFor's certificate function
// keeps what it captured, from two functions it builds here: one with a
// static certificate, one with a certificate holder. Anything not found as
// expected leaves every such function unrecognised, and configs presenting
// one pass through.
var certClosureLayout = sync.OnceValue(func() certClosure {
	certPEM, keyPEM, err := selfSignedPair()
	if err != nil {
		return certClosure{}
	}
	staticCfg := &transport.Config{TLS: transport.TLSConfig{CertData: certPEM, KeyData: keyPEM}}
	holderCfg := &transport.Config{TLS: transport.TLSConfig{GetCertHolder: &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return nil, nil }}}}
	s, err1 := transport.TLSConfigFor(staticCfg)
	h, err2 := transport.TLSConfigFor(holderCfg)
	if err1 != nil || err2 != nil || s == nil || h == nil || s.GetClientCertificate == nil || h.GetClientCertificate == nil {
		return certClosure{}
	}
	sf, hf := s.GetClientCertificate, h.GetClientCertificate
	l := certClosure{code: reflect.ValueOf(sf).Pointer(), static: -1, loader: -1, config: -1}
	if reflect.ValueOf(hf).Pointer() != l.code {
		return certClosure{}
	}
	cert, err := sf(&tls.CertificateRequestInfo{})
	if err != nil || cert == nil {
		return certClosure{}
	}
	for i := 1; i <= certClosureCaptures; i++ {
		sw, hw := certClosureWord(sf, i), certClosureWord(hf, i)
		switch {
		case sw == unsafe.Pointer(cert) && hw == nil && l.static < 0:
			l.static = i
		case sw == unsafe.Pointer(staticCfg) && hw == unsafe.Pointer(holderCfg) && l.config < 0:
			l.config = i
		case sw == nil && hw == nil && l.loader < 0:
			l.loader = i
		default:
			return certClosure{}
		}
	}
	l.ok = l.static > 0 && l.loader > 0 && l.config > 0
	return l
})

// selfSignedPair returns a throwaway certificate and key, PEM-encoded.
func selfSignedPair() (certPEM, keyPEM []byte, err error) {
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, key)
	if err != nil {
		return nil, nil, err
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}), nil
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
	return samePool(gotTLS.RootCAs, g.roots) || readsCAFile(rt, id.caFile)
}

// sameHTTP2 reports whether got speaks HTTP/2 as want does, when want offers
// h2: a protocol list named in the config keeps h2 where DISABLE_HTTP2 left
// HTTP/2 off, so two transports built on either side of a change of the
// variable offer the same list and only one of them speaks what it offers.
func sameHTTP2(got, want *http.Transport) bool {
	return !slices.Contains(want.TLSClientConfig.NextProtos, "h2") || speaksHTTP2(got) == speaksHTTP2(want)
}

// clientGoUpgrades reports whether every function t hands a negotiated
// protocol's connections to (TLSNextProto: HTTP/2) is the one HTTP/2 as
// client-go configures it registers. One of anyone else's (a transport of the
// config's own) carries every request on such a connection, and may change
// it: the pool's connections would not.
func clientGoUpgrades(t *http.Transport) bool {
	if t.Protocols != nil {
		t = t.Clone() // settled: net/http registers its HTTP/2 at first use
	}
	for _, f := range t.TLSNextProto {
		if !slices.Contains(http2Upgrades(), reflect.ValueOf(f).Pointer()) {
			return false
		}
	}
	return true
}

// http2Upgrades is the code of the functions x/net's HTTP/2, which client-go
// configures, registers in a transport's TLSNextProto (net/http's own, where
// x/net hands HTTP/2 to it).
var http2Upgrades = sync.OnceValue(func() []uintptr {
	t := &http.Transport{TLSClientConfig: &tls.Config{}}
	if _, err := http2.ConfigureTransports(t); err != nil {
		return nil
	}
	settleProtocols(t)
	var codes []uintptr
	for _, f := range t.TLSNextProto {
		codes = append(codes, reflect.ValueOf(f).Pointer())
	}
	return codes
})

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

// clientGoTransport unwraps rt to the *http.Transport client-go built, through
// client-go's own holders (its cache's garbage-collection and CA-reload
// holders) only: a wrapper of anyone else's between client-go and the hook
// (inserted with transport.Wrappers before the hook) is a layer the pool must
// not replace, so such a round tripper passes through.
func clientGoTransport(rt http.RoundTripper) *http.Transport {
	for range 4 {
		if t, ok := rt.(*http.Transport); ok {
			return t
		}
		w, ok := rt.(utilnet.RoundTripperWrapper)
		if !ok {
			return nil
		}
		if name := clientGoHolder(rt); name != "trackedTransport" && name != "atomicTransportHolder" {
			return nil
		}
		rt = w.WrappedRoundTripper()
	}
	return nil
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

// clientGoHolder names the type of rt when it is one of client-go's transport
// package's own round trippers (a pointer to a struct there), or "".
func clientGoHolder(rt http.RoundTripper) string {
	t := reflect.TypeOf(rt)
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct || t.Elem().PkgPath() != "k8s.io/client-go/transport" {
		return ""
	}
	return t.Elem().Name()
}

// readsCAFile reports whether rt is client-go's CA-reloading holder for
// caFile (client-go v0.36+, ClientsAllowCARotation): its roots are that
// file's, refreshed on client-go's own schedule, so the pool (which reloads
// the same file sooner) trusts what it trusts. A transport with the same
// roots from inline data is not such a holder.
func readsCAFile(rt http.RoundTripper, caFile string) bool {
	if caFile == "" {
		return false
	}
	for range 8 {
		if clientGoHolder(rt) == "atomicTransportHolder" {
			f := reflect.ValueOf(rt).Elem().FieldByName("caFile")
			if f.Kind() != reflect.String {
				return false
			}
			abs, err := filepath.Abs(f.String())
			return err == nil && abs == caFile
		}
		w, ok := rt.(utilnet.RoundTripperWrapper)
		if !ok {
			return false
		}
		rt = w.WrappedRoundTripper()
	}
	return false
}

// envProxierCode is the code of the proxy function client-go's transports use
// for configs without Proxy.
var envProxierCode = reflect.ValueOf(utilnet.NewProxierWithNoProxyCIDR(http.ProxyFromEnvironment)).Pointer()

func isEnvProxier(proxy func(*http.Request) (*url.URL, error)) bool {
	return proxy != nil && reflect.ValueOf(proxy).Pointer() == envProxierCode
}

// routesByEnvironment reports whether proxy is shown to route by the
// environment: http.ProxyFromEnvironment itself, which is what client-go's
// transports use for configs without Proxy unless NO_PROXY names a CIDR.
// With such a CIDR they use a closure of utilnet.NewProxierWithNoProxyCIDR,
// whose code is also that of a config's own Proxy built with it around
// another function: such a proxy function is asked per request.
func routesByEnvironment(proxy func(*http.Request) (*url.URL, error)) bool {
	return proxy != nil && reflect.ValueOf(proxy).Pointer() == reflect.ValueOf(http.ProxyFromEnvironment).Pointer()
}

// isClientGoTransportFor reports whether got is the transport client-go's cache
// holds for id's certificate files: the proof that got reads the same files,
// which no comparison of what it presents can give (a copy naming other files
// with the same bytes presents the same certificate until the files diverge).
func isClientGoTransportFor(got *http.Transport, id *identity) bool {
	if id.clientGoKey == nil || !isEnvProxier(got.Proxy) {
		// Only a transport client-go built for a config without Proxy can
		// be in its cache; asking the cache about another would build the
		// identity's transport, and its certificate refresher, for nothing.
		return false
	}
	key := *id.clientGoKey // client-go fills in what it reads from the files
	key.NextProtos = slices.Clone(key.NextProtos)
	rt, err := transport.New(&transport.Config{TLS: key, DisableCompression: id.disableCompression})
	return err == nil && clientGoTransport(rt) == got
}

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

// dialFingerprint tells which dialer a transport dials with, so the hook can
// show that client-go's transport for a client dials as the shared one does.
// Dial functions cannot be compared in Go; their closures can. A func value
// points to a closure record whose first word is the code pointer and whose
// next words are what it captured (for a method value, the receiver). Two
// copies of one func value point to one record. client-go's default dialer is
// a fresh (&net.Dialer{...}).DialContext per transport, recognised by its code
// pointer and its receiver's settings, and client-go wraps dialers in
// connrotation.Dialer (certificate files, exec plugins), which dials through
// the dialer it wraps: the fingerprint looks through it. Anything this cannot
// read is unknown, and unknown never matches.
type dialFingerprint struct {
	kind    dialKind
	closure unsafe.Pointer // kind dialFunc: the closure record, kept alive so its address is not reused
}

type dialKind uint8

const (
	dialUnknown dialKind = iota
	dialDefault          // client-go's default dialer
	dialFunc             // one particular func value
)

var defaultDial = dialFingerprint{kind: dialDefault}

func (f dialFingerprint) known() bool { return f.kind != dialUnknown }

type dialFn = func(ctx context.Context, network, address string) (net.Conn, error)

// closureOf returns the closure record of a func value.
func closureOf(f dialFn) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&f)) }

// receiverOf returns the receiver a method value captured. The caller checks
// the code pointer first.
func receiverOf[R any](f dialFn) *R {
	return *(**R)(unsafe.Add(closureOf(f), unsafe.Sizeof(uintptr(0))))
}

var (
	netDialerCode = reflect.ValueOf((&net.Dialer{}).DialContext).Pointer()
	rotDialerCode = reflect.ValueOf(connrotation.NewDialer(nil).DialContext).Pointer()
)

// dialInspection reports whether closures look as fingerprintDial expects on
// this toolchain; if not, every dialer is unknown and configs whose dialer
// must be shown pass through.
var dialInspection = sync.OnceValue(func() bool {
	d := &net.Dialer{Timeout: time.Second}
	inner := d.DialContext
	rd := connrotation.NewDialer(inner)
	outer := rd.DialContext
	if reflect.ValueOf(inner).Pointer() != netDialerCode || receiverOf[net.Dialer](inner) != d ||
		reflect.ValueOf(outer).Pointer() != rotDialerCode || receiverOf[connrotation.Dialer](outer) != rd {
		return false
	}
	got, ok := wrappedDial(rd)
	return ok && closureOf(got) == closureOf(inner)
})

// wrappedDial reads the dialer a connrotation.Dialer dials through.
func wrappedDial(rd *connrotation.Dialer) (dialFn, bool) {
	f := reflect.ValueOf(rd).Elem().FieldByName("dial")
	if !f.IsValid() || f.Type() != reflect.TypeFor[connrotation.DialFunc]() {
		return nil, false
	}
	return *(*dialFn)(unsafe.Pointer(f.UnsafeAddr())), true
}

// execTracker returns the connection tracker of a connrotation dialer (the one
// client-go's exec authenticator closes when the plugin's certificate
// changes), or nil.
func execTracker(f dialFn) *connrotation.ConnectionTracker {
	if f == nil || !dialInspection() || reflect.ValueOf(f).Pointer() != rotDialerCode {
		return nil
	}
	return receiverOf[connrotation.Dialer](f).ConnectionTracker
}

func fingerprintDial(f dialFn) dialFingerprint {
	if f == nil || !dialInspection() {
		return dialFingerprint{}
	}
	for range 4 {
		code := reflect.ValueOf(f).Pointer()
		switch {
		case code == rotDialerCode:
			inner, ok := wrappedDial(receiverOf[connrotation.Dialer](f))
			if !ok || inner == nil {
				return dialFingerprint{}
			}
			f = inner
			continue
		case code == netDialerCode && isClientGoDialer(receiverOf[net.Dialer](f)):
			return defaultDial
		}
		return dialFingerprint{kind: dialFunc, closure: closureOf(f)}
	}
	return dialFingerprint{}
}

// isClientGoDialer reports whether d is set as client-go sets its default
// dialer: 30 s timeout and keep-alive, everything else zero.
func isClientGoDialer(d *net.Dialer) bool {
	if d == nil || d.Timeout != 30*time.Second || d.KeepAlive != 30*time.Second {
		return false
	}
	v := reflect.ValueOf(d).Elem()
	for i := range v.NumField() {
		switch v.Type().Field(i).Name {
		case "Timeout", "KeepAlive":
		default:
			if !v.Field(i).IsZero() {
				return false
			}
		}
	}
	return true
}

// connectHeaderFor returns the headers cfg's CONNECT requests carry: those a
// wrapper already in cfg.WrapTransport sets on the transport below it, or else
// those WithProxyConnectHeader gives. Such a wrapper (Karmada's
// Spec.ProxyHeader clones the *http.Transport it is handed and sets
// ProxyConnectHeader on the clone) sits above the hook and is handed the
// pool's round tripper, so it would do nothing: the pool finds out what it
// does by running cfg.WrapTransport once, at Wrap, over a probe transport.
// share is false when the wrappers replace the transport in any other way:
// the pool cannot give that to shared connections, and dropping it silently
// would change what the config does.
func (p *Pool) connectHeaderFor(cfg *rest.Config) (h http.Header, fromWrappers, share bool) {
	if cfg.WrapTransport != nil {
		h, replaced, ok := probeWrappers(cfg.WrapTransport)
		if !ok {
			p.opts.logger.V(2).Info("Config passes through: a wrapper in its WrapTransport replaces the transport below it with more than CONNECT headers", "host", redactHost(cfg.Host))
			return nil, false, false
		}
		if replaced {
			return h, true, true
		}
	}
	if p.opts.connectHeader != nil {
		h = p.opts.connectHeader(cfg).Clone()
	}
	return h, false, true
}

// probeWrappers runs wrap over a probe transport. replaced reports that wrap
// handed back another *http.Transport, or changed the probe in place; ok
// that the result differs from the probe in its CONNECT headers at most (a
// static header: GetProxyConnectHeader is not recognised).
func probeWrappers(wrap transport.WrapperFunc) (h http.Header, replaced, ok bool) {
	// The probe has a TLS configuration, as client-go's transports do, for
	// wrappers that change theirs.
	probe := &http.Transport{Proxy: probeProxy, DialContext: probeDial, TLSClientConfig: &tls.Config{}}
	pristine := probe.Clone()
	out, ran := runWrappers(wrap, probe)
	if !ran {
		return nil, true, false
	}
	t := httpTransport(out)
	if t == nil || t == probe {
		// A wrapper may also change the transport it is handed in place:
		// the pool's round tripper would hide that change from it too.
		if !sameButConnectHeader(probe, pristine) || probe.GetProxyConnectHeader != nil {
			return nil, true, false
		}
		if probe.ProxyConnectHeader != nil {
			return probe.ProxyConnectHeader.Clone(), true, true
		}
		return nil, false, true
	}
	if t.GetProxyConnectHeader != nil || !sameButConnectHeader(t, probe) {
		return nil, true, false
	}
	return t.ProxyConnectHeader.Clone(), true, true
}

// runWrappers returns what wrap makes of probe; ran is false when it panics.
// A wrapper written for client-go's transports may not expect a probe, and
// what it does to theirs is then unknown.
func runWrappers(wrap transport.WrapperFunc, probe *http.Transport) (out http.RoundTripper, ran bool) {
	defer func() {
		if recover() != nil {
			out, ran = nil, false
		}
	}()
	return wrap(probe), true
}

func isProbe(rt http.RoundTripper) bool {
	t, ok := rt.(*http.Transport)
	return ok && t.Proxy != nil && reflect.ValueOf(t.Proxy).Pointer() == reflect.ValueOf(probeProxy).Pointer()
}

func probeProxy(*http.Request) (*url.URL, error) {
	return nil, errors.New("sharedtransport: probe transport")
}

func probeDial(context.Context, string, string) (net.Conn, error) {
	return nil, errors.New("sharedtransport: probe transport")
}

// sameButConnectHeader compares every exported field of two transports but
// ProxyConnectHeader and GetProxyConnectHeader; their TLS configurations
// (a clone's is a copy) must set nothing, as the probe's.
func sameButConnectHeader(a, b *http.Transport) bool {
	return sameFields(a, b, probeFields()) && tlsUnset(a.TLSClientConfig) && tlsUnset(b.TLSClientConfig)
}

// tlsUnset reports whether c is a TLS configuration that sets no exported
// field.
func tlsUnset(c *tls.Config) bool {
	if c == nil {
		return false
	}
	v := reflect.ValueOf(c).Elem()
	for _, i := range tlsFields() {
		if !v.Field(i).IsZero() {
			return false
		}
	}
	return true
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
	probeFields = sync.OnceValue(func() []int {
		return exportedFieldsBut(reflect.TypeFor[http.Transport](), "ProxyConnectHeader", "GetProxyConnectHeader", "TLSClientConfig")
	})
	tlsFields        = sync.OnceValue(func() []int { return exportedFieldsBut(reflect.TypeFor[tls.Config]()) })
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
