// Package conns carries one TLS identity's requests to the wire over
// transports built as client-go builds its own: net/http decides when a
// request goes and when a connection is dialed. A Transports adds what
// net/http cannot do: keep-alive off with resumption, upgrades over
// HTTP/1.1, counted connections, and a drain when the material rotates.
package conns

import (
	"context"
	"crypto/tls"
	"errors"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

const (
	SessionCacheSize = 64 // TLS sessions: one per server of the identity, with room to spare
	// idleRecheckDelay is how long after a retired Transports' request ends its idle
	// connections close once more: Go frees an HTTP/2 stream just after its body ends.
	idleRecheckDelay = 50 * time.Millisecond
)

// ErrRetired is returned for a request whose Transports closed (drain over)
// before the request was sent: it may be sent on the newer one.
var ErrRetired = errors.New("sharedtransport: the TLS material this request was to be sent with was rotated away before it was sent")

// Config is what a Transports is built from.
type Config struct {
	TLS                *tls.Config                                                          // nil for plain http; copied, its VerifyConnection counts handshakes
	Dial               func(ctx context.Context, network, address string) (net.Conn, error) // nil: client-go's dialer
	Proxy              func(*http.Request) (*url.URL, error)                                // nil: the environment's
	ProxyConnectHeader http.Header
	DisableCompression bool
	DisableHTTP2       bool // DISABLE_HTTP2 as the identity first saw it
	KeepAlive          bool
	SessionCache       tls.ClientSessionCache // nil: no resumption; one per certificate, as a session authenticates as its own
	Counters           *Counters              // counted into; never nil
}

// Counters are connection figures, counted as connections open and close.
type Counters struct {
	Dials, Handshakes, Resumptions atomic.Uint64
	Open                           atomic.Int64
}

// Transports are one identity's transports for one version of its TLS
// material. Retired, it serves what it was given, closes connections as
// they become idle and the rest when the drain ends.
type Transports struct {
	shared   *http.Transport // every request but upgrades, built as client-go builds its own
	http1    *http.Transport // upgrades, which need HTTP/1.1; shared when it has no HTTP/2
	own      func() *http.Transport
	counters *Counters
	retired  atomic.Bool

	// closing ends, under mu, when t closes: dials stop, and are refused.
	closing context.Context
	end     context.CancelFunc

	// mu guards the fields below; a newer Transports' mu is taken before
	// an older one's, never the other way round.
	mu          sync.Mutex
	cause       error              // what Close was given; nil when the drain ended
	conns       map[*Conn]struct{} // dialed and not closed
	older       []*Transports      // taken over from and maybe draining; none once t is retired
	drainTimer  *time.Timer
	idleRecheck *time.Timer
}

// NewTransports builds Transports for c, keep-alive set before HTTP/2 is
// configured so that the HTTP/2 pool reads it. prev, if set, is the
// Transports this one takes over from: Close closes it too while it drains.
func NewTransports(c Config, prev *Transports) *Transports {
	t := &Transports{counters: c.Counters, conns: map[*Conn]struct{}{}}
	t.closing, t.end = context.WithCancel(context.Background())
	if prev != nil {
		t.older = append(prev.olderOpen(), prev)
	}
	tlsConfig := c.TLS
	if tlsConfig != nil {
		tlsConfig = tlsConfig.Clone()
		tlsConfig.NextProtos = slices.Clone(tlsConfig.NextProtos) // net/http may write the list at first use
		tlsConfig.ClientSessionCache = c.SessionCache
		tlsConfig.VerifyConnection = t.countHandshake
	}
	http1TLS := http1Only(tlsConfig) // before HTTP/2 set-up adds h2 to tlsConfig
	// Keep-alive off, HTTP/2 brings nothing but surplus dials. Once set up,
	// the ALPN list tells HTTP/2, under x/net's and under net/http's own.
	if c.KeepAlive && tlsConfig != nil {
		t.shared = t.newTransport(c, tlsConfig)
	}
	if t.shared == nil || !slices.Contains(tlsConfig.NextProtos, http2.NextProtoTLS) {
		t.shared = t.newTransport(c, http1TLS)
		t.http1, tlsConfig = t.shared, http1TLS
	} else {
		t.http1 = t.newTransport(c, http1TLS)
	}
	t.own = func() *http.Transport { return t.newTransport(c, ownSessions(tlsConfig)) }
	return t
}

// Shared carries every request but upgrades: what utilnet.TLSClientConfig
// and a caller's WrappedRoundTripper see.
func (t *Transports) Shared() *http.Transport { return t.shared }

// Own builds a transport for a caller that unwraps the pool's round tripper
// and may change it: shared with no one, its connections closed with t's.
func (t *Transports) Own() *http.Transport { return t.own() }

// Retire takes t out of use for new requests: idle connections close now,
// busy ones as they become idle, and what is left when drain ends.
func (t *Transports) Retire(drain time.Duration) {
	t.retired.Store(true)
	t.closeIdle()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.older = nil
	t.drainTimer = time.AfterFunc(drain, func() { t.close(nil) }) // once: a generation retires once
}

// Close closes every connection of t and of those it took over from, busy
// ones included: dials refused and response bodies cut fail with cause.
func (t *Transports) Close(cause error) {
	for _, o := range append(t.olderOpen(), t) {
		o.close(cause)
	}
}

// CloseIdle closes the idle connections of t and of those it took over from.
func (t *Transports) CloseIdle() {
	for _, o := range append(t.olderOpen(), t) {
		o.closeIdle()
	}
}

// olderOpen returns the Transports t took over from that are not closed.
func (t *Transports) olderOpen() []*Transports {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(t.older), func(o *Transports) bool { return o.isClosed() })
}

func (t *Transports) close(cause error) {
	t.mu.Lock()
	if t.isClosed() {
		t.mu.Unlock()
		return
	}
	t.cause = cause
	t.end()
	for _, timer := range []*time.Timer{t.drainTimer, t.idleRecheck} {
		if timer != nil {
			timer.Stop()
		}
	}
	conns := slices.Collect(maps.Keys(t.conns))
	t.mu.Unlock()
	t.retired.Store(true)
	t.closeIdle()
	for _, c := range conns {
		c.Close()
	}
}

// closedBy is Close's cause: nil while t is open, or when its drain closed it.
func (t *Transports) closedBy() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.cause
}

func (t *Transports) isClosed() bool { return t.closing.Err() != nil }

func (t *Transports) closeIdle() {
	t.shared.CloseIdleConnections()
	t.http1.CloseIdleConnections() // twice when they are one: idle is idle
}

// requestEnded is called when a response body ends. On a retired t it
// closes idle connections now and once more when the stream is free.
func (t *Transports) requestEnded() {
	if !t.retired.Load() {
		return
	}
	t.closeIdle()
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.isClosed(): // close stopped the timer; none is set after it
	case t.idleRecheck == nil:
		t.idleRecheck = time.AfterFunc(idleRecheckDelay, t.closeIdle)
	default:
		t.idleRecheck.Reset(idleRecheckDelay)
	}
}
