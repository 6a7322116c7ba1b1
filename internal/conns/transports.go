// Package conns carries one TLS identity's requests to the wire: the
// transports built for one version of its material, the connections they
// dial, and when a request may take a stream, so that a burst opens the
// connections it needs and no more. What it needs comes in a Config.
package conns

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// sessionCacheSize is how many TLS sessions one Transports keeps: one per
// server the identity talks to, with room to spare.
const sessionCacheSize = 64

// idleRecheckDelay is how long after a request of a retired Transports
// ends its idle connections are closed once more: Go frees an HTTP/2 stream
// just after its body ends.
const idleRecheckDelay = 50 * time.Millisecond

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
	// MaxConnsPerHost caps the connections to one host of this Transports
	// and the ones it took over from together; 0: no cap.
	MaxConnsPerHost int
	Counters        []*Counters
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
	shared   *http.Transport // every request but upgrades
	http1    *http.Transport // upgrades, which need HTTP/1.1; shared when that has no HTTP/2
	http2    bool            // shared speaks HTTP/2
	maxConns int
	counters []*Counters
	protos   *protocols // shared with the identity's other Transports
	conns    *connSet   // every connection dialed

	hostsMu  sync.RWMutex // guards hosts
	hosts    map[hostKey]*host
	lastHost atomic.Pointer[host] // most identities talk to one host

	retired  atomic.Bool
	closedCh chan struct{} // closed once, by Close, with cause set: no more dials

	mu sync.Mutex // guards older, cause, drainTimer and idleRecheck
	// older are the Transports this one took over from that may still be
	// draining; none once it is retired itself (the newer one holds them).
	older       []*Transports
	cause       error       // what Close was given
	drainTimer  *time.Timer // closes a retired Transports at the end of its drain
	idleRecheck *time.Timer // closes idle connections once more after a retired request ends

	// Under a cap: shortRequests counts the requests in flight that are not
	// watches; with yieldingCap set, the HTTP/2 connections close once it is 0.
	shortRequests atomic.Int64
	yieldingCap   atomic.Bool
}

// NewTransports builds Transports for c as client-go's tlsTransportCache
// builds its own (utilnet.SetTransportDefaults), with keep-alive set before
// HTTP/2 is configured, so that the HTTP/2 pool reads it. prev, if set, is
// the Transports this one takes over from: they share what they know of the
// hosts, and under a cap prev and its predecessors yield their connections.
func NewTransports(c Config, prev *Transports) *Transports {
	t := &Transports{
		maxConns: c.MaxConnsPerHost,
		counters: c.Counters,
		protos:   &protocols{},
		conns:    &connSet{conns: map[*Conn]struct{}{}},
		hosts:    map[hostKey]*host{},
		closedCh: make(chan struct{}),
	}
	if prev != nil {
		t.protos = prev.protos
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
		t.shared = t.newTransport(c, tlsConfig)
		t.http2 = speaksHTTP2(t.shared)
	}
	if !t.http2 {
		t.shared = t.newTransport(c, http1TLS)
		t.http1 = t.shared
		return t
	}
	// One dial at a time per host: a request that finds no stream where
	// the count saw one (GOAWAY, fewer streams) makes net/http dial, and
	// those behind it wait for that connection. A connection that cannot
	// take a stream leaves net/http's count, so the next can be dialed.
	t.shared.MaxConnsPerHost = max(t.maxConns, 1)
	t.http1 = t.newTransport(c, http1TLS)
	return t
}

// Shared is the transport that carries every request but upgrades: what
// utilnet.TLSClientConfig and a caller's WrappedRoundTripper should see.
func (t *Transports) Shared() *http.Transport { return t.shared }

// Hosts lists the hosts the identity has talked to, as scheme://host, sorted.
func (t *Transports) Hosts() []string { return t.protos.names() }

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
	older := t.olderOpen()
	t.close(cause)
	for _, o := range older {
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
	t.mu.Unlock()
	t.retired.Store(true)
	t.closeIdle()
	for _, c := range t.conns.close() {
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
	t.closeIdle()
	for _, o := range t.olderOpen() {
		o.closeIdle()
	}
}

func (t *Transports) closeIdle() {
	t.shared.CloseIdleConnections()
	if t.http1 != t.shared {
		t.http1.CloseIdleConnections()
	}
}

// requestEnded is called when a request that held a place, or counted in
// shortRequests (short), ends.
func (t *Transports) requestEnded(short bool) {
	if short && t.shortRequests.Add(-1) == 0 && t.yieldingCap.Load() {
		t.closeStreams()
	}
	if !t.retired.Load() {
		return
	}
	// Closes idle connections now and once more when the stream is free.
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

// takeCap is called under a cap before a request that may dial: the
// Transports t took over from close their HTTP/2 connections once only
// watches run on them, rather than at the end of their drain; the watches
// resume on t, as after client-go's own rotation, which closes every
// connection at once.
func (t *Transports) takeCap() {
	if t.retired.Load() {
		return
	}
	for _, o := range t.olderOpen() {
		o.yieldingCap.Store(true)
		if o.shortRequests.Load() == 0 {
			o.closeStreams()
		}
	}
}

// closeStreams closes t's HTTP/2 connections, the ones requests were seen
// on, and leaves upgraded connections (exec, port-forward) to their callers.
func (t *Transports) closeStreams() {
	for _, c := range t.conns.all() {
		if c.carriesStreams() {
			c.Close()
		}
	}
}
