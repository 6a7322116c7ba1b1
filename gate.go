// How a generation sends requests to a host. net/http and x/net own the
// connections and their streams; the pool adds two things. A cold-start
// gate: while a host has no HTTP/2 connection of the generation, or a dial
// for one is in flight, requests go to net/http one at a time, each once the
// one before it has a connection or a dial of its own, so a burst opens the
// connections the server's stream limit needs, not one per request. The cap
// (WithMaxConnsPerHost) is in hosts.go and the dialer, sending in send.go.

package sharedtransport

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"time"
)

// hostGate is one generation's cold-start gate for one host. A request
// goes to net/http at once while the host has an HTTP/2 connection of the
// generation and nothing waits, or, for a host speaking HTTP/1.1, while
// another request to it is in flight. Otherwise requests take turns: the
// one holding the turn gives it up when it gets a connection (then the next
// goes), when it starts a dial (then all wait for the dial), or when its
// round trip ends. A dial ends when its handshake does: the next goes, or,
// when the host turned out to speak HTTP/1.1, every waiter goes. A dial
// that fails fails its waiters at once with its error, as x/net's own
// coalesced dials do.
type hostGate struct {
	g    *generation
	key  hostKey
	info *hostInfo

	mu      sync.Mutex // guards the fields below, and those of pending and countedConn it names
	turn    bool       // a request holds the turn
	active  int        // requests in a round trip
	dialing int        // dials of the host's requests whose handshake has not ended
	lost    int        // dials whose connection closed before its handshake ended, until their round trip tells why
	h2conns int        // live HTTP/2 connections
	waiters []*pending
}

func (g *generation) hostFor(req *http.Request) *hostGate {
	k := hostKey{req.URL.Scheme, req.URL.Host}
	if h := g.lastHost.Load(); h != nil && h.key == k {
		return h
	}
	g.hostsMu.RLock()
	h, ok := g.hosts[k]
	g.hostsMu.RUnlock()
	if !ok {
		g.hostsMu.Lock()
		if h, ok = g.hosts[k]; !ok {
			h = &hostGate{g: g, key: k, info: g.known.get(k)}
			g.hosts[k] = h
		}
		g.hostsMu.Unlock()
	}
	g.lastHost.Store(h)
	return h
}

// pending is one request on its way through a host's gate and net/http.
type pending struct {
	h     *hostGate
	ctx   context.Context
	ready chan error // a waiter's admission: nil, or the error of the dial it waited for
	trace httptrace.ClientTrace

	// Guarded by h.mu. Its dials count in h.dialing from the dialer until
	// they are connecting (the dialer returned, the handshake runs) and
	// pooling (an HTTP/2 connection joins net/http's pool) no more.
	turn       bool // it holds h's turn
	connecting []*countedConn
	pooling    int
	lost       int  // its dials counted in h.lost
	done       bool // its round trip returned
}

// poolSettle is how long a new HTTP/2 connection whose request returned
// before its handshake ended has to join net/http's pool before the next
// waiter goes.
const poolSettle = 20 * time.Millisecond

// pendingKey marks the context of a request the gate let through, so the
// dialer (whose context net/http derives from the request's) knows whose
// dial it makes.
type pendingKey struct{}

// enter returns when p may go to net/http, or why it may not: its context
// ended, the generation closed (errRetired), or the dial it waited for failed.
func (h *hostGate) enter(p *pending) error {
	h.mu.Lock()
	h.active++
	if !h.g.http2 || h.http1FreeLocked() || h.freeLocked() && h.h2conns > 0 && h.g.maxConns == 0 {
		h.mu.Unlock()
		return nil
	}
	if h.freeLocked() {
		h.turn, p.turn = true, true
		h.mu.Unlock()
		return nil
	}
	p.ready = make(chan error, 1)
	h.waiters = append(h.waiters, p)
	h.mu.Unlock()
	var err error
	select {
	case err = <-p.ready:
		return err
	case <-p.ctx.Done():
		err = p.ctx.Err()
	case <-h.g.shutCh:
		err = errRetired
	}
	h.mu.Lock()
	if i := slices.Index(h.waiters, p); i >= 0 {
		h.waiters = slices.Delete(h.waiters, i, i+1)
	}
	h.mu.Unlock()
	return err // ended passes on a turn it was handed meanwhile
}

// http1FreeLocked: a host speaking HTTP/1.1 takes requests at once while
// another request to it is in flight and none probes it. With nothing in
// flight (a server back after a failover, say) the first goes alone until
// its connection tells the protocol.
func (h *hostGate) http1FreeLocked() bool {
	return h.info.proto.Load() == protoHTTP1 && h.active > 1 && !h.turn && len(h.waiters) == 0
}

func (h *hostGate) freeLocked() bool {
	return !h.turn && h.dialing == 0 && h.lost == 0 && len(h.waiters) == 0
}

// nextLocked lets the first waiter go with the turn, when nothing holds it.
func (h *hostGate) nextLocked() {
	if h.turn || h.dialing > 0 || h.lost > 0 || len(h.waiters) == 0 {
		return
	}
	p := h.waiters[0]
	h.waiters = slices.Delete(h.waiters, 0, 1)
	h.turn, p.turn = true, true
	p.ready <- nil
}

// releaseLocked lets every waiter go, or fail with err.
func (h *hostGate) releaseLocked(err error) {
	for _, p := range h.waiters {
		p.ready <- err
	}
	h.waiters = nil
}

func (h *hostGate) learnLocked(proto int32) {
	h.info.proto.Store(proto)
	if proto == protoHTTP1 {
		h.releaseLocked(nil)
	}
}

// dropTurnLocked takes the turn from p, when it holds it.
func (p *pending) dropTurnLocked() {
	if p.turn {
		p.turn, p.h.turn = false, false
	}
}

// attach returns req carrying p to the dialer and, where the gate needs
// them, the connection events of req.
func (p *pending) attach(req *http.Request) *http.Request {
	ctx := context.WithValue(req.Context(), pendingKey{}, p)
	if p.h.g.http2 {
		p.trace = httptrace.ClientTrace{GotConn: p.gotConn, TLSHandshakeDone: p.handshakeDone}
		if p.h.g.maxConns > 0 {
			p.trace.WroteHeaders = p.wroteHeaders
		}
		ctx = httptrace.WithClientTrace(ctx, &p.trace)
	}
	return req.WithContext(ctx)
}

// gotConn learns from the connection req got: the protocol ALPN chose (an
// HTTP/1.1 connection reused from an earlier time says nothing new).
func (p *pending) gotConn(info httptrace.GotConnInfo) {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	proto := connProto(info.Conn)
	if proto == protoHTTP2 || !info.Reused || h.info.proto.Load() == protoUnknown {
		h.learnLocked(proto)
	}
	if proto == protoHTTP2 {
		h.countLocked(info.Conn)
	}
	p.settleLocked()
	if proto == protoHTTP2 && h.g.maxConns > 0 {
		// Under a cap, x/net queues a request on a connection at its
		// stream limit (StrictMaxConcurrentStreams), counting every
		// request that took a place on it: one at a time takes a place
		// and waits there for a stream, the others wait here.
		return
	}
	p.dropTurnLocked()
	h.nextLocked()
}

// wroteHeaders is told that p's request has its stream.
func (p *pending) wroteHeaders() {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	p.dropTurnLocked()
	h.nextLocked()
}

// countLocked counts conn, an HTTP/2 connection, among the generation's
// live ones to the host, once.
func (h *hostGate) countLocked(conn net.Conn) {
	tc, _ := conn.(*tls.Conn)
	if tc == nil {
		return
	}
	if c, ok := tc.NetConn().(*countedConn); ok && c.gate == h && !c.counted && !c.closed.Load() {
		c.counted = true
		c.h2.Store(true)
		h.h2conns++
	}
}

func connProto(conn net.Conn) int32 {
	if tc, ok := conn.(*tls.Conn); ok && tc.ConnectionState().NegotiatedProtocol == http2NextProto {
		return protoHTTP2
	}
	return protoHTTP1
}

const http2NextProto = "h2"

func (p *pending) dialStarted() {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dialing++
	if h.info.proto.Load() != protoHTTP1 {
		p.dropTurnLocked() // the waiters wait for the dial
	}
}

// dialed is told how p's dial ended in the dialer: c, or err (real: not
// because the dial's context ended). A plain-http connection is ready as it
// is; a TLS one once its handshake ends.
func (p *pending) dialed(c *countedConn, err error, real bool) {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case c == nil:
		h.dialEndedLocked(p, err, real)
	case h.key.scheme == "http":
		h.dialEndedLocked(p, nil, false)
	default:
		c.dialFor = p
		p.connecting = append(p.connecting, c)
	}
}

// handshakeDone ends the handshake of one of p's connections. The trace
// does not say which: when p dialed more than once at a time, the first
// stands for it, and p's connection or return settles the rest.
func (p *pending) handshakeDone(cs tls.ConnectionState, err error) {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(p.connecting) == 0 {
		return
	}
	c := p.connecting[0]
	c.dialFor = nil
	c.h2.Store(cs.NegotiatedProtocol == http2NextProto)
	p.connecting = slices.Delete(p.connecting, 0, 1)
	switch {
	case err != nil:
		real := !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
		h.dialEndedLocked(p, err, real)
	case cs.NegotiatedProtocol == http2NextProto:
		h.learnLocked(protoHTTP2)
		// The connection joins net/http's pool after the handshake: the
		// dial ends when p gets a connection or returns.
		p.pooling++
		p.settleSoonLocked()
	default:
		h.learnLocked(protoHTTP1)
		h.dialEndedLocked(p, nil, false)
	}
}

// settleSoonLocked settles the dials of a p that returned a moment from
// now, as x/net lets a coalesced dial wait a moment for its leader's
// connection: the next waiter then finds it in net/http's pool.
func (p *pending) settleSoonLocked() {
	if !p.done || p.pooling+len(p.connecting) == 0 {
		return
	}
	time.AfterFunc(poolSettle, func() {
		p.h.mu.Lock()
		defer p.h.mu.Unlock()
		p.settleLocked()
	})
}

// settleLocked ends p's dials that are connecting or pooling: p got a
// connection, or returned a while ago.
func (p *pending) settleLocked() {
	h := p.h
	for _, c := range p.connecting {
		c.dialFor = nil
	}
	h.dialing -= p.pooling + len(p.connecting)
	p.pooling, p.connecting = 0, nil
	h.nextLocked()
}

// dialEndedLocked ends one of p's dials: ready (err nil), or failed.
func (h *hostGate) dialEndedLocked(p *pending, err error, real bool) {
	h.dialing--
	if err != nil && real {
		h.releaseLocked(err)
	}
	p.dropTurnLocked()
	h.nextLocked()
}

// connClosed is told that c closed. A connection that closes before its
// handshake ended (a refused CONNECT, a handshake cut) failed its dial; the
// round trip it was dialed for tells why, unless it already returned.
func (h *hostGate) connClosed(c *countedConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if c.counted {
		c.counted = false
		h.h2conns--
	}
	p := c.dialFor
	if p == nil {
		return
	}
	c.dialFor = nil
	p.connecting = slices.DeleteFunc(p.connecting, func(x *countedConn) bool { return x == c })
	h.dialing--
	if !p.done {
		h.lost++
		p.lost++
	}
	h.nextLocked()
}

// ended is told that p's round trip returned, with err when it failed.
func (p *pending) ended(err error) {
	h := p.h
	h.mu.Lock()
	defer h.mu.Unlock()
	h.active--
	p.done = true
	p.settleSoonLocked()
	if p.lost > 0 {
		h.lost -= p.lost
		p.lost = 0
		if err != nil && p.ctx.Err() == nil {
			h.releaseLocked(err)
		}
	}
	p.dropTurnLocked()
	h.nextLocked()
}
