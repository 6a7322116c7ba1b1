// Package conns carries one TLS identity's requests to the wire: the
// transports built for one version of its material and the connections
// they dial. net/http decides when a request goes and when a connection is
// dialed; a Transports adds what net/http cannot do: one request leads
// while a host's protocol is unknown, keep-alive off with resumption, and
// a drain when the material rotates. What it needs comes in a Config.
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
)

const (
	// sessionCacheSize is how many TLS sessions one Transports keeps: one
	// per server the identity talks to, with room to spare.
	sessionCacheSize = 64
	// idleRecheckDelay is how long after a request of a retired Transports
	// ends its idle connections are closed once more: Go frees an HTTP/2
	// stream just after its body ends.
	idleRecheckDelay = 50 * time.Millisecond
)

// ErrRetired is returned for a request whose Transports closed (drain over)
// before the request was sent: it may be sent on the newer one.
var ErrRetired = errors.New("sharedtransport: the TLS material this request was to be sent with was rotated away before it was sent")

// Config is what a Transports is built from.
type Config struct {
	// TLS configures the connections; nil for plain http. It has no
	// VerifyConnection (handshakes are counted there); Transports copies it.
	TLS                *tls.Config
	Dial               func(ctx context.Context, network, address string) (net.Conn, error) // nil: client-go's dialer
	Proxy              func(*http.Request) (*url.URL, error)                                // nil: the environment's
	ProxyConnectHeader http.Header
	DisableCompression bool
	DisableHTTP2       bool // DISABLE_HTTP2 as the identity first saw it
	KeepAlive          bool
	// ResumeSessions gives the Transports a TLS session cache of its own: a
	// resumed session authenticates as the certificate it came from.
	ResumeSessions bool
	Counters       *Counters // counted into; never nil
}

// Counters are connection figures, counted as connections open and close.
type Counters struct {
	Dials, Handshakes, Resumptions atomic.Uint64
	Open                           atomic.Int64
}

// Transports are one identity's transports for one version of its TLS
// material. Retired when the next is built, it serves what it was given and
// closes connections as they become idle, and the rest when the drain ends.
type Transports struct {
	shared   *http.Transport // HTTP/2 hosts, one dial at a time; every request when it has no HTTP/2
	open     *http.Transport // HTTP/1.1 hosts: client-go's own transport, dialing what they need
	http1    *http.Transport // upgrades, which need HTTP/1.1
	http2    bool            // shared speaks HTTP/2
	own      func() *http.Transport
	counters *Counters
	hosts    *hosts // shared with the identity's other Transports

	retired  atomic.Bool
	closedCh chan struct{} // closed once, by close, with cause set: no more dials

	mu    sync.Mutex         // guards conns, older, cause, drainTimer and idleRecheck
	conns map[*Conn]struct{} // every connection dialed and not closed
	// older are the Transports this one took over from that may still be
	// draining; none once it is retired itself (the newer one holds them).
	older       []*Transports
	cause       error       // what Close was given
	drainTimer  *time.Timer // closes a retired Transports at the end of its drain
	idleRecheck *time.Timer // closes idle connections once more after a retired request ends
}

// NewTransports builds Transports for c as client-go's tlsTransportCache
// builds its own (utilnet.SetTransportDefaults), with keep-alive set before
// HTTP/2 is configured, so that the HTTP/2 pool reads it. prev, if set, is
// the Transports this one takes over from: they share what they know of the
// hosts, and Close closes prev too while it drains.
func NewTransports(c Config, prev *Transports) *Transports {
	t := &Transports{
		counters: c.Counters,
		hosts:    &hosts{},
		conns:    map[*Conn]struct{}{},
		closedCh: make(chan struct{}),
	}
	if prev != nil {
		t.hosts = prev.hosts
		t.older = append(prev.olderOpen(), prev)
	}
	tlsConfig := c.TLS
	if tlsConfig != nil {
		tlsConfig = tlsConfig.Clone()
		tlsConfig.NextProtos = slices.Clone(tlsConfig.NextProtos) // net/http may write the list at first use
		if c.ResumeSessions {
			tlsConfig.ClientSessionCache = tls.NewLRUClientSessionCache(sessionCacheSize)
		}
		tlsConfig.VerifyConnection = t.countHandshake
	}
	http1TLS := http1Only(tlsConfig) // before HTTP/2 set-up adds h2 to tlsConfig
	// With keep-alive off every request has a connection of its own:
	// HTTP/2 brings nothing, and Go's HTTP/2 pool dials surplus connections
	// under concurrency. Plain http has no HTTP/2 to offer either.
	if c.KeepAlive && tlsConfig != nil {
		t.open = t.newTransport(c, tlsConfig.Clone())
		t.http2 = speaksHTTP2(t.open)
	}
	if !t.http2 {
		t.shared = t.newTransport(c, http1TLS)
		t.open, t.http1 = t.shared, t.shared
		t.own = func() *http.Transport { return t.newTransport(c, ownSessions(http1TLS)) }
		return t
	}
	t.own = func() *http.Transport { return t.newTransport(c, ownSessions(tlsConfig)) }
	// One dial at a time per host: a request that finds every connection
	// full dials, and those behind it wait for that connection instead of
	// dialing one each. A full connection leaves net/http's count, so a
	// busy host still gets the connections it needs. It would serialize an
	// HTTP/1.1 host's requests: those go over open.
	t.shared = t.newTransport(c, tlsConfig)
	t.shared.MaxConnsPerHost = 1
	t.http1 = t.newTransport(c, http1TLS)
	return t
}

// Shared is the transport that carries every request but upgrades: what
// utilnet.TLSClientConfig and a caller's WrappedRoundTripper should see.
func (t *Transports) Shared() *http.Transport { return t.shared }

// Own builds a transport as client-go builds its own, for a caller that
// unwraps the pool's round tripper and may change what it finds: shared
// with no one, its connections counted and closed with t's.
func (t *Transports) Own() *http.Transport { return t.own() }

// Hosts lists the hosts the identity has talked to, as scheme://host, sorted.
func (t *Transports) Hosts() []string { return t.hosts.names() }

// Retire takes t out of use for new requests: idle connections close now,
// busy ones as they become idle, and what is left when drain ends.
func (t *Transports) Retire(drain time.Duration) {
	t.retired.Store(true)
	t.closeIdle()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.older = nil
	if t.drainTimer == nil {
		t.drainTimer = time.AfterFunc(drain, func() { t.close(nil) })
	}
}

// Close closes every connection of t and of the Transports it took over
// from, busy ones included. Requests refused from then on, and response
// bodies cut, fail with cause.
func (t *Transports) Close(cause error) {
	for _, o := range append(t.olderOpen(), t) {
		o.close(cause)
	}
}

// olderOpen returns the Transports t took over from that are not closed.
func (t *Transports) olderOpen() []*Transports {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(t.older), func(o *Transports) bool { return o.closed() })
}

func (t *Transports) close(cause error) {
	t.mu.Lock()
	if t.closed() {
		t.mu.Unlock()
		return
	}
	t.cause = cause
	close(t.closedCh)
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

// closed reports whether Close (or the end of the drain) closed t.
func (t *Transports) closed() bool {
	select {
	case <-t.closedCh:
		return true
	default:
		return false
	}
}

// closedBy is the cause Close was given; nil while t is open, or when its
// drain closed it.
func (t *Transports) closedBy() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.cause
}

// CloseIdle closes the idle connections of t and of the Transports it took
// over from.
func (t *Transports) CloseIdle() {
	for _, o := range append(t.olderOpen(), t) {
		o.closeIdle()
	}
}

func (t *Transports) closeIdle() {
	for _, rt := range []*http.Transport{t.shared, t.open, t.http1} {
		rt.CloseIdleConnections() // twice when they are one: idle is idle
	}
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
	case t.closed():
	case t.idleRecheck == nil:
		t.idleRecheck = time.AfterFunc(idleRecheckDelay, t.closeIdle)
	default:
		t.idleRecheck.Reset(idleRecheckDelay)
	}
}
