package sharedtransport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/util/httpstream"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/transport"
)

// client-go's values for the transports it builds (transport/cache.go).
const (
	// streamsPerConn is kube-apiserver's default HTTP/2 stream limit
	// (--http2-max-streams-per-connection, 100 since v1.25).
	streamsPerConn = 100
	// streamsInFlight leaves a margin under it where the pool caps
	// connections: a stream whose response body ended is still counted by
	// the connection for a moment, and a request arriving then finds no
	// free stream and has to come back for one.
	streamsInFlight = streamsPerConn * 9 / 10

	idleConnsPerHost    = 25
	tlsHandshakeTimeout = 10 * time.Second
	dialTimeout         = 30 * time.Second
	tcpKeepAlive        = 30 * time.Second

	// retiredSettle is how long after the last request of a retired
	// generation ends its idle connections are closed once more: Go frees
	// an HTTP/2 stream shortly after its body ends, so a connection may turn
	// idle just after the request that used it let go.
	retiredSettle = 50 * time.Millisecond
	// growWait is how long a host's HTTP/2 connections stay full, with
	// requests waiting, before one of them goes to get another connection:
	// about a TLS handshake on a busy host.
	growWait = 10 * time.Millisecond
	// eofSettle is how long a body read to EOF and not closed keeps its
	// stream slot: about the time Go takes to free the stream.
	eofSettle = 10 * time.Millisecond
	// maxResends bounds how often a request is moved to a newer generation
	// because its own closed before it was sent.
	maxResends = 3
)

// errNoDial is what the HTTP/2 transport's dialer answers a request the pool
// did not send to get a connection: one that found no free stream where the
// pool counted one (a connection that died or a server allowing fewer
// streams). Nothing was sent; the request goes back to the pool's gate.
var errNoDial = errors.New("sharedtransport: no free stream where one was counted")

// errRetired is returned by a generation that a rotation closed (drain
// timeout over, or zero) before a request was sent on it; the lease sends the
// request on the current one.
var errRetired = errors.New("sharedtransport: the TLS material this request was to be sent with was rotated away before it was sent")

// generation is one identity's transports for one version of its TLS
// material. A rotation builds a new generation and retires the old one: the
// old one closes its connections as they become idle, and the ones still
// busy after the drain timeout.
type generation struct {
	// transport carries every request but upgrades. When it can speak
	// HTTP/2 it dials only for the requests hostConns sends to get a
	// connection: left to itself, Go dials for every request that finds no
	// free stream, so a burst of N concurrent first requests opens about N
	// connections instead of ceil(N/streams) (seed 002: 300 requests, 320
	// connections).
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

	// What the generation authenticates with, for comparing with the
	// transports client-go hands the hook: the roots it trusts, and the
	// client certificate it presents (nil when none, or when it comes from
	// an exec plugin and is asked for at handshake time).
	roots *x509.CertPool
	leaf  []byte
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
	shutCh   chan struct{}
	shutOnce sync.Once
	settleMu sync.Mutex  // guards settle
	settle   *time.Timer // closes idle connections after the last request of a retired generation

	connsMu sync.Mutex // guards conns and closed
	conns   map[*countedConn]struct{}
	closed  bool
}

// newGeneration builds transports the way client-go's tlsTransportCache
// does (transport.TLSConfigFor, utilnet.SetTransportDefaults: HTTP/2 with
// health checks, proxy environment, DISABLE_HTTP2), plus the pool's options.
// Keep-alive is set before HTTP/2 is configured: the HTTP/2 connection pool
// reads it from this transport. The generation shares e.hosts, what the
// identity learnt about its hosts, with every other generation of e.
func (p *Pool) newGeneration(e *entry, m *material) (*generation, error) {
	id := e.id
	tlsConfig, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{
		Insecure:      id.insecure,
		ServerName:    id.serverName,
		NextProtos:    id.nextProtos,
		CAData:        m.caPEM,
		CertData:      m.certPEM,
		KeyData:       m.keyPEM,
		GetCertHolder: id.getCert,
	}})
	if err != nil {
		return nil, err
	}
	g := &generation{
		maxConns: p.opts.maxConnsPerHost,
		owner:    e,
		known:    &e.hosts,
		material: m,
		stats:    &p.stats,
		hosts:    map[hostKey]*hostConns{},
		shutCh:   make(chan struct{}),
		conns:    map[*countedConn]struct{}{},
	}
	var http1TLS *tls.Config
	if tlsConfig != nil {
		g.roots = tlsConfig.RootCAs
		if len(m.certPEM) > 0 {
			leaf, err := parseLeaf(m)
			if err != nil {
				return nil, err
			}
			g.leaf, g.certCN, g.certNotAfter = leaf.Raw, leaf.Subject.CommonName, leaf.NotAfter
		}
		if p.opts.sessionResumption && id.getCert == nil {
			// One cache per generation: a resumed session carries the client
			// certificate of the handshake it came from. An exec plugin's
			// certificate can change without a new generation, and a resumed
			// session would go on authenticating as the old one, so such
			// identities do not resume.
			tlsConfig.ClientSessionCache = tls.NewLRUClientSessionCache(p.opts.sessionCacheSz)
		}
		tlsConfig.VerifyConnection = g.countHandshake
		http1TLS = tlsConfig.Clone()
		if len(id.nextProtos) == 0 {
			http1TLS.NextProtos = []string{"http/1.1"}
		}
	}

	dial := id.dial
	if dial == nil {
		dial = (&net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}).DialContext
	}
	// With keep-alive off every request has a connection of its own:
	// HTTP/2 brings nothing, and Go's HTTP/2 pool dials surplus connections
	// under concurrency (a connection per request over HTTP/1.1, more than
	// one per request over HTTP/2). Plain http (through a proxy) has no
	// HTTP/2 to offer either.
	if p.opts.keepAlive && tlsConfig != nil {
		g.transport = g.newTransport(id, p.opts.keepAlive, tlsConfig, dial, true)
		// SetTransportDefaults leaves HTTP/2 off under DISABLE_HTTP2 and
		// for ALPN lists without h2, as client-go does.
		_, g.http2 = g.transport.TLSNextProto["h2"]
	}
	if g.http2 {
		g.http1 = g.newTransport(id, p.opts.keepAlive, http1TLS, dial, false)
	} else {
		g.transport = g.newTransport(id, p.opts.keepAlive, http1TLS, dial, false)
		g.http1 = g.transport
	}
	return g, nil
}

// parseLeaf returns the client certificate of m, which loadMaterial checked
// against its key.
func parseLeaf(m *material) (*x509.Certificate, error) {
	cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
	if err != nil {
		return nil, err
	}
	if cert.Leaf != nil {
		return cert.Leaf, nil
	}
	return x509.ParseCertificate(cert.Certificate[0]) // GODEBUG x509keypairleaf=0
}

// newTransport builds one of g's transports as client-go's cache builds
// its own, dialing through g (see dialer).
func (g *generation) newTransport(id *identity, keepAlive bool, tlsConfig *tls.Config, dial dialContextFunc, onlyLooked bool) *http.Transport {
	return utilnet.SetTransportDefaults(&http.Transport{
		Proxy:               id.proxy, // nil: SetTransportDefaults installs the environment's proxy, like client-go
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: idleConnsPerHost,
		DialContext:         g.dialer(dial, onlyLooked),
		DisableCompression:  id.disableCompression,
		DisableKeepAlives:   !keepAlive,
		ProxyConnectHeader:  id.connectHeader,
	})
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
// dial for a generation that was closed. With onlyLooked (the HTTP/2
// transport) it dials only for a request the pool sent to get a connection
// (see hostConns): Go would otherwise dial for every request that finds no
// free stream, and on a server that stopped speaking HTTP/2 queue the others
// behind the one HTTP/1.1 connection it got.
func (g *generation) dialer(dial dialContextFunc, onlyLooked bool) dialContextFunc {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		if g.shut.Load() {
			return nil, g.refusal(address)
		}
		if onlyLooked && ctx.Value(lookKey{}) == nil {
			return nil, errNoDial
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

// countFor makes c one of hc's connections, unless it is closed or counted
// already.
func (c *countedConn) countFor(hc *hostConns) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.host != nil {
		return false
	}
	c.host = hc
	return true
}

// What an identity knows about a host: the protocol its server spoke on the
// last new connection that could tell (ALPN, at the end of the handshake).
// It is kept per host, because one identity's hosts can differ, and shared
// by the identity's generations, because a rotation changes the client's
// certificate, not the server.
const (
	protoUnknown int32 = iota
	protoHTTP2
	protoHTTP1
)

type hostKey struct{ scheme, host string }

type hostTable struct {
	mu    sync.Mutex // guards hosts
	hosts map[hostKey]*atomic.Int32
}

func (t *hostTable) get(k hostKey) *atomic.Int32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.hosts == nil {
		t.hosts = map[hostKey]*atomic.Int32{}
	}
	proto, ok := t.hosts[k]
	if !ok {
		proto = &atomic.Int32{}
		t.hosts[k] = proto
	}
	return proto
}

// hostConns is one generation's traffic to one host. It decides, for every
// request but upgrades, which transport sends it and when:
//
//   - While the protocol is unknown, one request goes first and the others
//     wait for its connection (not its response): ALPN tells the protocol
//     when the handshake ends. If it fails before it has a connection, the
//     next waiter goes.
//   - Over HTTP/2, requests go out while the connections the host is known
//     to have leave streams free; beyond that one request goes to get the
//     next connection and the others wait for it, so a burst opens
//     ceil(N/100) connections. With a cap they wait for a stream instead
//     once the cap's connections are full.
//   - Over HTTP/1.1, requests go out at once, as many as the cap allows,
//     each on an idle connection or a new one, which offers HTTP/2: the
//     pool sees when the server speaks it again. When none is in flight
//     (a server back after a failover) the first goes alone until it has
//     its connection.
//
// A request holds its place from admission until its response body ends
// (EOF or Close) or it fails.
type hostConns struct {
	g     *generation
	key   hostKey
	proto *atomic.Int32 // shared with the identity's other generations

	mu       sync.Mutex // guards the fields below
	inflight int        // requests on g.transport, from admission until their body ends
	conns    int        // live HTTP/2 connections seen in use by requests sent to get one
	leading  bool       // a request is getting the connection the waiters wait for
	// fullSince is when requests began to wait for a stream on the
	// host's HTTP/2 connections; zero when none waits.
	fullSince time.Time
	waiters   []chan struct{}
}

// admission is where a request goes and what it holds.
type admission struct {
	rt   *http.Transport
	slot bool // counted in inflight until its body ends
	lead bool // the waiters wait for its connection
	look bool // its connection tells the protocol: trace it
}

func (g *generation) hostFor(req *http.Request) *hostConns {
	k := hostKey{req.URL.Scheme, req.URL.Host}
	if hc := g.lastHost.Load(); hc != nil && hc.key == k {
		return hc
	}
	g.hostsMu.RLock()
	hc, ok := g.hosts[k]
	g.hostsMu.RUnlock()
	if !ok {
		g.hostsMu.Lock()
		if hc, ok = g.hosts[k]; !ok {
			hc = &hostConns{g: g, proto: g.known.get(k), key: k}
			g.hosts[k] = hc
		}
		g.hostsMu.Unlock()
	}
	g.lastHost.Store(hc)
	return hc
}

func (hc *hostConns) protocol() int32 {
	if !hc.g.http2 {
		return protoHTTP1
	}
	return hc.proto.Load()
}

// admit returns where req goes, waiting (bounded by its context) while it
// must. It returns errRetired when the generation was closed meanwhile.
// A request that bounced (errNoDial) goes to get a connection itself if it
// may, and otherwise waits for the next connection or stream before it is
// admitted again.
func (hc *hostConns) admit(ctx context.Context, bounced bool) (admission, error) {
	hc.mu.Lock()
	for {
		if bounced {
			bounced = false
			if a, ok := hc.tryLeadLocked(); ok {
				hc.mu.Unlock()
				return a, nil
			}
		} else if a, ok := hc.tryAdmitLocked(); ok {
			hc.mu.Unlock()
			return a, nil
		}
		ready := make(chan struct{}, 1)
		hc.waiters = append(hc.waiters, ready)
		var grow *time.Timer
		var growC <-chan time.Time
		if d := hc.growDelayLocked(); d > 0 {
			grow = time.NewTimer(d)
			growC = grow.C
		}
		hc.mu.Unlock()
		var err error
		select {
		case <-ready:
		case <-growC:
		case <-ctx.Done():
			err = ctx.Err()
		case <-hc.g.shutCh:
			err = errRetired
		}
		if grow != nil {
			grow.Stop()
		}
		hc.mu.Lock()
		if i := slices.Index(hc.waiters, ready); i >= 0 {
			hc.waiters = slices.Delete(hc.waiters, i, i+1)
		} else if err != nil {
			hc.wakeOneLocked() // it was woken: pass it on
		}
		if err != nil {
			hc.mu.Unlock()
			return admission{}, err
		}
	}
}

// growDelayLocked is how long the host's connections have yet to stay full
// before a request goes to get another one (see tryAdmitLocked), or 0.
func (hc *hostConns) growDelayLocked() time.Duration {
	if hc.fullSince.IsZero() || hc.leading {
		return 0
	}
	return max(growWait-time.Since(hc.fullSince), time.Nanosecond)
}

func (hc *hostConns) tryAdmitLocked() (admission, bool) {
	g := hc.g
	if g.shut.Load() {
		return admission{}, false // the caller's wait returns errRetired at once
	}
	switch hc.protocol() {
	case protoUnknown:
		if hc.leading {
			return admission{}, false
		}
		return hc.leadLocked(), true
	case protoHTTP2:
		perConn, conns := streamsPerConn, hc.conns
		if g.maxConns > 0 {
			perConn, conns = streamsInFlight, min(conns, g.maxConns)
		}
		if hc.inflight < conns*perConn {
			if len(hc.waiters) == 0 {
				hc.fullSince = time.Time{}
			}
			hc.inflight++
			return admission{rt: g.transport, slot: true}, true
		}
		if g.maxConns > 0 && hc.conns >= g.maxConns || hc.leading {
			return admission{}, false
		}
		if hc.conns > 0 {
			// Full: streams often free up sooner than a handshake ends
			// (a burst of short lists), and a connection that comes up
			// after that is closed as surplus. Another one is got when
			// the connections have stayed full for growWait.
			now := time.Now()
			if hc.fullSince.IsZero() {
				hc.fullSince = now
			}
			if now.Sub(hc.fullSince) < growWait {
				return admission{}, false
			}
		}
		hc.fullSince = time.Time{}
		return hc.leadLocked(), true
	default: // HTTP/1.1
		if !g.http2 {
			if g.maxConns == 0 {
				return admission{rt: g.transport}, true
			}
			if hc.inflight < g.maxConns {
				hc.inflight++
				return admission{rt: g.transport, slot: true}, true
			}
			return admission{}, false
		}
		if hc.leading || g.maxConns > 0 && hc.inflight >= g.maxConns {
			return admission{}, false
		}
		// Each request may get a new connection, which offers HTTP/2:
		// look at every one. When nothing is in flight (a host back
		// after a failover, say), the others wait for the first one's
		// connection: if it speaks HTTP/2 they go there too.
		lead := hc.inflight == 0
		hc.leading = lead
		hc.inflight++
		return admission{rt: g.transport, slot: true, lead: lead, look: true}, true
	}
}

// tryLeadLocked admits a request that found no free stream as the one that
// gets the next connection, when no other is getting one and the cap allows
// another.
func (hc *hostConns) tryLeadLocked() (admission, bool) {
	g := hc.g
	if g.shut.Load() || hc.leading || hc.protocol() != protoHTTP2 || g.maxConns > 0 && hc.conns >= g.maxConns {
		return admission{}, false
	}
	return hc.leadLocked(), true
}

// leadLocked admits a request as the one that gets the connection the
// waiters wait for.
func (hc *hostConns) leadLocked() admission {
	hc.leading = true
	hc.inflight++
	return admission{rt: hc.g.transport, slot: true, lead: true, look: true}
}

func (hc *hostConns) wakeOneLocked() {
	if len(hc.waiters) > 0 {
		hc.waiters[0] <- struct{}{}
		hc.waiters = slices.Delete(hc.waiters, 0, 1)
	}
}

func (hc *hostConns) wakeAllLocked() {
	for _, w := range hc.waiters {
		w <- struct{}{}
	}
	hc.waiters = hc.waiters[:0]
}

// release ends a request's hold: its body ended, or it failed.
func (hc *hostConns) release() {
	hc.mu.Lock()
	hc.inflight--
	hc.wakeOneLocked()
	hc.mu.Unlock()
	if hc.g.retired.Load() {
		hc.g.closeIdleSoon()
	}
}

// trackLocked counts c, an HTTP/2 connection, among the host's.
func (hc *hostConns) trackLocked(c *countedConn) {
	if c.countFor(hc) {
		hc.conns++
		hc.wakeAllLocked()
	}
}

func (hc *hostConns) connClosed() {
	hc.mu.Lock()
	hc.conns--
	hc.wakeAllLocked() // one of them may have to get the next connection
	hc.mu.Unlock()
}

// setProtocolLocked records what a new connection (or a connection over
// HTTP/2, which only a server speaking it gives) showed.
func (hc *hostConns) setProtocolLocked(proto int32) {
	if hc.proto.Swap(proto) != proto {
		hc.wakeAllLocked()
	}
}

// look follows one request to learn from the connection it gets.
type look struct {
	hc   *hostConns
	lead bool        // the waiters wait for this request's connection
	got  atomic.Bool // it got one
}

// lookKey marks the context of a request sent to get a connection: the
// HTTP/2 transport dials for no other.
type lookKey struct{}

func (l *look) trace(req *http.Request) *http.Request {
	ctx := context.WithValue(req.Context(), lookKey{}, l)
	return req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{GotConn: l.gotConn}))
}

// gotConn learns from conn at the moment the request got it: the protocol
// ALPN chose, and, over HTTP/2, one more connection the host can rely on.
// An HTTP/1.1 connection reused from an earlier time says nothing new.
func (l *look) gotConn(info httptrace.GotConnInfo) {
	var proto int32 = protoHTTP1
	var conn *countedConn
	if tc, ok := info.Conn.(*tls.Conn); ok {
		if tc.ConnectionState().NegotiatedProtocol == "h2" {
			proto = protoHTTP2
		}
		conn, _ = tc.NetConn().(*countedConn)
	} else {
		conn, _ = info.Conn.(*countedConn)
	}
	hc := l.hc
	hc.mu.Lock()
	defer hc.mu.Unlock()
	switch {
	case proto == protoHTTP2:
		if conn != nil {
			hc.trackLocked(conn)
		}
		hc.setProtocolLocked(proto)
	case !info.Reused || hc.proto.Load() == protoUnknown:
		hc.setProtocolLocked(proto)
	}
	l.doneLocked()
}

// doneLocked lets the waiters go: the request has its connection, or gave up.
func (l *look) doneLocked() {
	if l.got.Swap(true) || !l.lead {
		return
	}
	l.hc.leading = false
	l.hc.wakeAllLocked()
}

// ended is called when the request's round trip returns.
func (l *look) ended(resp *http.Response) {
	hc := l.hc
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if !l.got.Load() && resp != nil && hc.proto.Load() == protoUnknown {
		// A response without a connection seen: a round tripper that
		// reports none. Its protocol is all there is to go by.
		proto := protoHTTP1
		if resp.ProtoMajor == 2 {
			proto = protoHTTP2
		}
		hc.setProtocolLocked(proto)
	}
	l.doneLocked()
}

// roundTrip sends req for lease l (which the response body keeps alive).
func (g *generation) roundTrip(l *lease, req *http.Request) (*http.Response, error) {
	if httpstream.IsUpgradeRequest(req) {
		// An upgraded connection is the caller's own, not a stream: no
		// place to hold, and its HTTP/1.1 response says nothing about the
		// server's HTTP/2.
		resp, err := g.http1.RoundTrip(req)
		if err != nil {
			return nil, err
		}
		resp.Body = wrapBody(resp.Body, l, nil)
		return resp, nil
	}
	hc := g.hostFor(req)
	bounced := false
	for {
		a, err := hc.admit(req.Context(), bounced)
		if err != nil {
			return nil, err
		}
		sent := req
		var lk *look
		if a.look {
			lk = &look{hc: hc, lead: a.lead}
			sent = lk.trace(req)
		}
		resp, err := a.rt.RoundTrip(sent)
		if lk != nil {
			lk.ended(resp)
		}
		if err != nil {
			if a.slot {
				hc.release()
			}
			if !errors.Is(err, errNoDial) {
				return nil, err
			}
			if req, err = resendable(req, err); err != nil {
				return nil, err
			}
			bounced = true
			continue
		}
		resp.Request = req
		if !a.slot {
			hc = nil
		}
		resp.Body = wrapBody(resp.Body, l, hc)
		return resp, nil
	}
}

// resendable returns req ready to be sent again on a newer generation after
// err (errRetired) stopped it before it was sent, or err when its body cannot
// be had again.
func resendable(req *http.Request, err error) (*http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return req, nil
	}
	if req.GetBody == nil {
		return nil, err
	}
	body, gerr := req.GetBody()
	if gerr != nil {
		return nil, err
	}
	again := req.Clone(req.Context())
	again.Body = body
	return again, nil
}

// wrapBody returns body keeping lease l, and so the identity and its
// connections, alive while the caller holds it: a watch or a followed log
// runs on after its clientset and config are gone, as with client-go alone.
// When hc is set the body ends the request's hold on it at EOF (as Go frees
// the stream), at an error, or at Close, whichever comes first, once. The
// wrapper keeps the interfaces of the transport's body: a 101 response's body
// stays writable.
func wrapBody(body io.ReadCloser, l *lease, hc *hostConns) io.ReadCloser {
	if body == http.NoBody {
		if hc != nil {
			hc.release()
		}
		return body
	}
	b := leasedBody{ReadCloser: body, lease: l, hc: hc}
	rw, ok := body.(io.ReadWriteCloser)
	switch {
	case !ok:
		return &b
	case hasCloseWrite(body):
		return &upgradedBodyCloseWrite{upgradedBody{&b, rw}}
	default:
		return &upgradedBody{&b, rw}
	}
}

type leasedBody struct {
	io.ReadCloser
	lease *lease // held, never used: it is what keeps the identity alive
	hc    *hostConns
	ended atomic.Bool
	eof   atomic.Bool
	timer atomic.Pointer[time.Timer] // ends the hold of a body read to EOF and not closed
}

func (b *leasedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case err == io.EOF:
		if b.hc != nil {
			b.endSoon()
		}
	default:
		b.end()
		if b.lease.e.closed.Load() {
			// Close cut the connection under the body: say so, as
			// RoundTrip does for a request Close cut.
			err = fmt.Errorf("%w while the response was read: %w", ErrClosed, err)
		}
	}
	return n, err
}

func (b *leasedBody) Close() error {
	err := b.ReadCloser.Close()
	if t := b.timer.Load(); t != nil {
		t.Stop()
	}
	b.end()
	return err
}

// endSoon ends the hold of a body read to EOF once Go has freed its stream:
// x/net frees it just after the EOF, in another goroutine, and Close waits
// for that. A body that is not closed at once ends its hold a moment later;
// a slot freed before the stream would send the next request to a
// connection that is still full.
func (b *leasedBody) endSoon() {
	if b.ended.Load() || b.eof.Swap(true) {
		return
	}
	b.timer.Store(time.AfterFunc(eofSettle, b.end))
}

func (b *leasedBody) end() {
	if b.hc != nil && !b.ended.Swap(true) {
		b.hc.release()
	}
}

// upgradedBody is a 101 response's body: the upgraded connection.
type upgradedBody struct {
	*leasedBody
	w io.Writer
}

func (b *upgradedBody) Write(p []byte) (int, error) { return b.w.Write(p) }

type closeWriter interface{ CloseWrite() error }

func hasCloseWrite(body io.ReadCloser) bool {
	_, ok := body.(closeWriter)
	return ok
}

type upgradedBodyCloseWrite struct{ upgradedBody }

func (b *upgradedBodyCloseWrite) CloseWrite() error {
	return b.ReadCloser.(closeWriter).CloseWrite()
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

// closeIdle closes the idle connections of every generation of e.
func (e *entry) closeIdle() {
	e.mu.Lock()
	gens := []*generation{e.current.Load()}
	for g := range e.draining {
		gens = append(gens, g)
	}
	e.mu.Unlock()
	for _, g := range gens {
		g.closeIdle()
	}
}

// CloseIdleConnections closes the idle connections of the identity's
// transports, so utilnet.CloseIdleConnectionsFor on a client reaches every
// transport its requests go over. Like client-go's shared transports, this
// also closes what other clients of the identity keep idle.
func (l *lease) CloseIdleConnections() { l.e.closeIdle() }
