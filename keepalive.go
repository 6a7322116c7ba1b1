// Building an identity's transports: one generation per version of its TLS
// material, built the way client-go builds its own, with the pool's
// keep-alive and session-resumption options applied before HTTP/2 is
// configured; the generation's dialer counts its connections and closes them
// when the generation closes. How requests are spread over the connections
// (cold-start gate, stream limiter) is in gate.go.

package sharedtransport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/transport"
)

// client-go's values for the transports it builds (transport/cache.go).
const (
	idleConnsPerHost    = 25
	tlsHandshakeTimeout = 10 * time.Second
	dialTimeout         = 30 * time.Second
	tcpKeepAlive        = 30 * time.Second
)

// retiredSettle is how long after the last request of a retired generation
// ends its idle connections are closed once more: Go frees an HTTP/2 stream
// shortly after its body ends, so a connection may turn idle just after the
// request that used it let go.
const retiredSettle = 50 * time.Millisecond

// sessionCacheSize is how many TLS sessions a generation's session cache
// keeps: one per server the identity talks to, with room to spare.
const sessionCacheSize = 64

// errRetired is returned by a generation that a rotation closed (drain
// timeout over, or zero) before a request was sent on it; the lease sends the
// request on the current one.
var errRetired = errors.New("sharedtransport: the TLS material this request was to be sent with was rotated away before it was sent")

// generation is one identity's transports for one version of its TLS
// material. A rotation builds a new generation and retires the old one: the
// old one closes its connections as they become idle, and the ones still
// busy after the drain timeout.
type generation struct {
	// transport carries every request but upgrades; hostConns decides when
	// a request goes to it, so that a burst of N concurrent first requests
	// opens about ceil(N/streams) connections instead of N.
	transport *http.Transport
	// http1 offers HTTP/1.1 only: upgrades (websocket, SPDY), which Go
	// sends over HTTP/1.1 on connections of their own and an HTTP/2
	// connection refuses. It is transport itself when transport cannot
	// speak HTTP/2.
	http1    *http.Transport
	http2    bool // transport speaks HTTP/2
	maxConns int  // the pool's cap per host; 0: none

	owner    *entry
	known    *hostTable // what the identity knows about its hosts, shared by its generations
	material *material
	stats    *counters
	// ca is the digest of material.caPEM: a client of Wrap rides g only
	// while it trusts what g trusts (clientTransport.pick).
	ca digest

	// The client certificate's subject and expiry, for Identities and the
	// expiry warning; warned says the warning for it was logged.
	certCN       string
	certNotAfter time.Time
	warned       atomic.Bool

	hostsMu  sync.RWMutex // guards hosts
	hosts    map[hostKey]*hostConns
	lastHost atomic.Pointer[hostConns] // the host used last: most identities talk to one

	// A retired generation (a newer one took over) still serves what it
	// was given, with the material it had, and closes connections as they
	// become idle; a closed one (drain over, or the pool closed) dials no
	// more and sends the requests waiting for a place back to the lease.
	retired  atomic.Bool
	shut     atomic.Bool
	shutCh   chan struct{} // closed, once, with shut set
	shutOnce sync.Once
	settleMu sync.Mutex  // guards settle
	settle   *time.Timer // closes idle connections after the last request of a retired generation

	connsMu sync.Mutex // guards conns and closed
	conns   map[*countedConn]struct{}
	closed  bool

	// Under WithMaxConnsPerHost: busy counts the requests in flight that
	// are not watches; yielding is set when a newer generation needs the
	// cap (entry.yieldCap), and the HTTP/2 connections close once busy is
	// zero.
	busy     atomic.Int64
	yielding atomic.Bool
}

// newGeneration builds e's transports for material m, the way client-go's
// tlsTransportCache builds its own (transport.TLSConfigFor,
// utilnet.SetTransportDefaults: HTTP/2 with health checks, proxy environment,
// DISABLE_HTTP2), plus the pool's options. The generation shares e.hosts,
// what the identity learnt about its hosts, with every other generation of e.
func (p *Pool) newGeneration(e *entry, m *material) (*generation, error) {
	id := e.id
	if len(m.certPEM) > 0 && m.cert == nil {
		return nil, errors.New("sharedtransport: internal error: a client certificate was not checked before use")
	}
	getCert := id.key.getCert
	if m.cert != nil {
		// The pair checkMaterial parsed, handed to client-go as a callback
		// rather than as bytes for it to parse again. client-go gives
		// inline data precedence over an exec plugin's callback: the pool
		// replaces the callback the same way.
		getCert = &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return m.cert, nil }}
	}
	tlsConfig, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{
		Insecure:      id.key.insecure,
		ServerName:    id.key.serverName,
		NextProtos:    id.nextProtos,
		CAData:        m.caPEM,
		GetCertHolder: getCert,
	}})
	if err != nil {
		return nil, err
	}
	if id.tlsConfig != nil {
		tlsConfig = id.tlsConfig.Clone() // TLSTransport: the caller's own, which holds no material
		tlsConfig.NextProtos = slices.Clone(tlsConfig.NextProtos)
	}
	g := &generation{
		maxConns: p.opts.maxConnsPerHost,
		owner:    e,
		known:    &e.hosts,
		material: m,
		stats:    &p.stats,
		ca:       digestOf(m.caPEM),
		hosts:    map[hostKey]*hostConns{},
		shutCh:   make(chan struct{}),
		conns:    map[*countedConn]struct{}{},
	}
	if tlsConfig != nil {
		p.setTLS(g, id, tlsConfig)
	}
	g.setTransports(id, p.opts.keepAlive, tlsConfig)
	return g, nil
}

// setTLS records what g authenticates with and completes tlsConfig, its TLS
// configuration: handshakes are counted, and resumed from a session cache of
// g's own when the pool resumes sessions.
func (p *Pool) setTLS(g *generation, id *identity, tlsConfig *tls.Config) {
	if c := g.material.cert; c != nil {
		g.certCN, g.certNotAfter = c.Leaf.Subject.CommonName, c.Leaf.NotAfter
	}
	if p.opts.sessionResumption && id.key.getCert == nil {
		// One cache per generation: a resumed session carries the client
		// certificate of the handshake it came from. An exec plugin's
		// certificate can change without a new generation, and a resumed
		// session would go on authenticating as the old one, so such
		// identities do not resume.
		tlsConfig.ClientSessionCache = tls.NewLRUClientSessionCache(sessionCacheSize)
	}
	tlsConfig.VerifyConnection = g.countHandshake
}

// setTransports builds g's transports over tlsConfig (nil for plain http).
// Keep-alive is set before HTTP/2 is configured: the HTTP/2 connection pool
// reads it from the transport it is configured on.
func (g *generation) setTransports(id *identity, keepAlive bool, tlsConfig *tls.Config) {
	dial := id.dial
	if dial == nil {
		dial = clientGoDialer.DialContext
	}
	http1TLS := http1Only(tlsConfig, id.nextProtos)
	// With keep-alive off every request has a connection of its own:
	// HTTP/2 brings nothing, and Go's HTTP/2 pool dials surplus connections
	// under concurrency (a connection per request over HTTP/1.1, more than
	// one per request over HTTP/2). Plain http (through a proxy) has no
	// HTTP/2 to offer either.
	if keepAlive && tlsConfig != nil {
		g.transport = g.newTransport(id, keepAlive, tlsConfig, dial)
		// SetTransportDefaults leaves HTTP/2 off under DISABLE_HTTP2 and
		// for ALPN lists without h2, as client-go does.
		g.http2 = speaksHTTP2(g.transport)
	}
	if g.http2 {
		// One dial at a time per host: a request that finds no stream where
		// the gate counted one (the connection got GOAWAY, the server allows
		// fewer streams) makes net/http dial, and the requests behind it
		// wait for that connection, which net/http hands to all of them,
		// instead of dialing one each. Over HTTP/2 a connection that cannot
		// take a stream leaves net/http's count, so the next one can be
		// dialed while it drains. HTTP/1.1 hosts go over http1.
		g.transport.MaxConnsPerHost = max(g.maxConns, 1)
	}
	if g.http2 {
		g.http1 = g.newTransport(id, keepAlive, http1TLS, dial)
	} else {
		g.transport = g.newTransport(id, keepAlive, http1TLS, dial)
		g.http1 = g.transport
	}
}

// speaksHTTP2 reports whether SetTransportDefaults turned HTTP/2 on for t.
// x/net's http2.ConfigureTransports does it in one of two ways: it registers
// its own HTTP/2 under TLSNextProto["h2"], or, where it wraps net/http's own
// HTTP/2 (newer x/net built with a Go that has it), it sets t.Protocols.
//
// t.Protocols is read first: where it is set, net/http writes t.TLSNextProto
// at t's first use, which may be running now on a transport of client-go's.
func speaksHTTP2(t *http.Transport) bool {
	if t.Protocols != nil && t.Protocols.HTTP2() {
		return true
	}
	_, ok := t.TLSNextProto["h2"]
	return ok
}

// settleProtocols has net/http finish configuring t's protocols before t is
// shared. Where net/http's own HTTP/2 serves t (t.Protocols set), net/http
// rewrites t.TLSClientConfig.NextProtos once, at first use; settled, the
// list can be read without racing that write. t has no connections yet, so
// closing its idle ones closes nothing.
func settleProtocols(t *http.Transport) {
	t.CloseIdleConnections()
}

// http1Only returns a copy of tlsConfig that offers HTTP/1.1 alone when the
// config names no protocols (an explicit list is the config's to keep), for
// upgrades and for transports that do not speak HTTP/2.
func http1Only(tlsConfig *tls.Config, nextProtos []string) *tls.Config {
	if tlsConfig == nil {
		return nil
	}
	c := tlsConfig.Clone()
	if len(nextProtos) == 0 {
		c.NextProtos = []string{"http/1.1"}
	}
	return c
}

// newTransport builds one of g's transports as client-go's cache builds
// its own, dialing through g (see dialer).
func (g *generation) newTransport(id *identity, keepAlive bool, tlsConfig *tls.Config, dial dialContextFunc) *http.Transport {
	t := utilnet.SetOldTransportDefaults(&http.Transport{
		Proxy:               id.proxy, // nil: SetTransportDefaults installs the environment's proxy, like client-go
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: idleConnsPerHost,
		MaxConnsPerHost:     g.maxConns,
		DialContext:         g.dialer(dial),
		DisableCompression:  id.key.disableCompression,
		DisableKeepAlives:   !keepAlive,
		ProxyConnectHeader:  id.connectHeader,
	})
	if !id.key.noHTTP2 {
		configureHTTP2(t)
	}
	settleProtocols(t)
	return t
}

// configureHTTP2 turns HTTP/2 on for t as utilnet.SetTransportDefaults
// does (not for an ALPN list without h2), with the same health checks and
// environment variables. DISABLE_HTTP2 is the identity's decision, made
// once (identityKey.noHTTP2), so that every generation of an identity speaks
// what its first did: SetTransportDefaults itself, at a rotation after the
// variable was set, would drop the HTTP/2 that client-go's transport of the
// same config still speaks (TestAdversaryDisableHTTP2AfterWrap).
func configureHTTP2(t *http.Transport) {
	if c := t.TLSClientConfig; c != nil && len(c.NextProtos) > 0 && !slices.Contains(c.NextProtos, http2.NextProtoTLS) {
		return
	}
	t2, err := http2.ConfigureTransports(t)
	if err != nil {
		return // SetTransportDefaults logs and goes on over HTTP/1.1
	}
	t2.ReadIdleTimeout = envSeconds("HTTP2_READ_IDLE_TIMEOUT_SECONDS", 30)
	t2.PingTimeout = envSeconds("HTTP2_PING_TIMEOUT_SECONDS", 15)
}

// envSeconds reads a duration in seconds from the environment variable
// name, as apimachinery reads its HTTP/2 health-check settings: def when
// unset or not a number.
func envSeconds(name string, def int) time.Duration {
	n, err := strconv.Atoi(os.Getenv(name))
	if err != nil {
		n = def
	}
	return time.Duration(n) * time.Second
}

type dialContextFunc = func(ctx context.Context, network, address string) (net.Conn, error)

func (g *generation) countHandshake(cs tls.ConnectionState) error {
	if cs.DidResume {
		g.stats.resumptions.Add(1)
		g.owner.stats.resumptions.Add(1)
	} else {
		g.stats.handshakes.Add(1)
		g.owner.stats.handshakes.Add(1)
	}
	return nil
}

// dialer wraps dial: it counts dials and open connections, keeps every
// connection the generation opened so close can close them, and refuses to
// dial for a generation that was closed. It dials whenever net/http, x/net
// or apimachinery (an upgrade through the transport's dialer) ask.
func (g *generation) dialer(dial dialContextFunc) dialContextFunc {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		if g.shut.Load() {
			return nil, g.refusal(address)
		}
		conn, err := dial(ctx, network, address)
		if err != nil {
			return nil, err
		}
		g.stats.dials.Add(1)
		g.stats.openConns.Add(1)
		g.owner.stats.dials.Add(1)
		g.owner.stats.openConns.Add(1)
		c := &countedConn{Conn: conn, g: g}
		g.connsMu.Lock()
		closed := g.closed
		if !closed {
			g.conns[c] = struct{}{}
		}
		g.connsMu.Unlock()
		if closed {
			// The generation closed while this dial ran.
			c.Close()
			return nil, g.refusal(address)
		}
		return c, nil
	}
}

// refusal is the error of a dial the generation no longer makes: ErrClosed
// when the pool (or the identity) is closed, errRetired when a rotation
// closed the generation, which the lease answers by sending the request on
// the current one.
func (g *generation) refusal(address string) error {
	if g.owner.closed.Load() {
		return fmt.Errorf("%w: dial %s", ErrClosed, address)
	}
	return fmt.Errorf("%w (dial %s)", errRetired, address)
}

// countedConn is a connection the generation dialed.
type countedConn struct {
	net.Conn
	g *generation

	mu     sync.Mutex // guards closed and host
	closed bool
	// host is set when the connection speaks HTTP/2 and a request sent to
	// get a connection got it: it counts among that host's connections.
	// Go hands such a request the first connection with a free stream, not
	// necessarily the one dialed for it, so a connection is counted when it
	// is seen in use: a new one that turned out surplus is never counted.
	host *hostConns
}

func (c *countedConn) Close() error {
	c.mu.Lock()
	first := !c.closed
	c.closed = true
	hc := c.host
	c.mu.Unlock()
	if first {
		c.g.stats.openConns.Add(-1)
		c.g.owner.stats.openConns.Add(-1)
		c.g.connsMu.Lock()
		delete(c.g.conns, c)
		c.g.connsMu.Unlock()
		if hc != nil {
			hc.connClosed()
		}
	}
	return c.Conn.Close()
}

// open reports whether c has not been closed.
func (c *countedConn) open() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.closed
}

// carriesStreams reports whether c is an open HTTP/2 connection of a host.
func (c *countedConn) carriesStreams() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.host != nil && !c.closed
}

// How countFor found a connection.
const (
	notCounted    = iota // closed, or another host's
	countedNow           // new among hc's connections
	countedBefore        // one of hc's connections already
)

// countFor makes c one of hc's connections, unless it is closed or counted
// already.
func (c *countedConn) countFor(hc *hostConns) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return notCounted
	case c.host == hc:
		return countedBefore
	case c.host != nil:
		return notCounted
	}
	c.host = hc
	return countedNow
}

// yieldCap closes g's HTTP/2 connections now if only watches run on them,
// or else when the last request that is not a watch ends (doneBusy).
func (g *generation) yieldCap() {
	g.yielding.Store(true)
	if g.busy.Load() == 0 {
		g.closeStreams()
	}
}

// doneBusy ends a request counted in busy.
func (g *generation) doneBusy() {
	if g.busy.Add(-1) == 0 && g.yielding.Load() {
		g.closeStreams()
	}
}

// closeStreams closes g's HTTP/2 connections, the ones requests were seen
// on, and leaves the others: upgraded connections (exec, port-forward) are
// their callers' own.
func (g *generation) closeStreams() {
	g.connsMu.Lock()
	var conns []*countedConn
	for c := range g.conns {
		if c.carriesStreams() {
			conns = append(conns, c)
		}
	}
	g.connsMu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// retire takes the generation out of use for new requests: idle connections
// close now and busy ones as soon as they become idle.
func (g *generation) retire() {
	g.retired.Store(true)
	g.closeIdle()
}

// closeIdleSoon closes idle connections now and once more when the
// generation's requests have settled.
func (g *generation) closeIdleSoon() {
	g.closeIdle()
	g.settleMu.Lock()
	defer g.settleMu.Unlock()
	if g.settle == nil {
		g.settle = time.AfterFunc(retiredSettle, g.closeIdle)
	} else {
		g.settle.Reset(retiredSettle)
	}
}

// close closes every connection of the generation, active ones included.
func (g *generation) close() {
	g.connsMu.Lock()
	g.closed = true
	conns := make([]*countedConn, 0, len(g.conns))
	for c := range g.conns {
		conns = append(conns, c)
	}
	g.connsMu.Unlock()
	g.shutOnce.Do(func() {
		g.shut.Store(true)
		close(g.shutCh)
	})
	g.retire()
	g.settleMu.Lock()
	if g.settle != nil {
		g.settle.Stop()
	}
	g.settleMu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

func (g *generation) closeIdle() {
	g.transport.CloseIdleConnections()
	if g.http1 != g.transport {
		g.http1.CloseIdleConnections()
	}
}

var clientGoDialer = &net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}
