// What a host learns from the connections its requests get: the protocol
// its server speaks (kept per identity, across rotations), the connections
// it has, and how many streams one takes.

package conns

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The protocol a host's server spoke on the last new connection that could
// tell (ALPN, at the end of the handshake).
const (
	protoUnknown int32 = iota
	protoHTTP2
	protoHTTP1
)

// protocols is what an identity knows of its hosts' protocols, shared by
// its Transports: a rotation changes the client, not the server.
type protocols struct {
	mu     sync.Mutex // guards byHost
	byHost map[hostKey]*atomic.Int32
}

func (p *protocols) get(k hostKey) *atomic.Int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byHost == nil {
		p.byHost = map[hostKey]*atomic.Int32{}
	}
	proto, ok := p.byHost[k]
	if !ok {
		proto = &atomic.Int32{}
		p.byHost[k] = proto
	}
	return proto
}

func (p *protocols) names() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for k := range p.byHost {
		out = append(out, k.scheme+"://"+k.host)
	}
	slices.Sort(out)
	return out
}

// learnLocked learns from c, the HTTP/2 connection a traced request got. A
// new one counts among the host's connections. A lead that got one the host
// had shows the count missed room: when more requests await their headers
// than it allowed, the server allows more streams; when the host's one
// connection was idle, the bodies counted hold no stream (the server ended
// them) and stop counting; otherwise the room may be streams whose bodies
// are about to end, and the next lead waits longer.
func (h *host) learnLocked(c *Conn, lead, idle bool) {
	isNew, mine := c.claim(h)
	switch {
	case isNew:
		h.conns++
		h.roomFoundAt = time.Time{}
		h.growAfter = growWait
		h.wakeAllLocked()
	case !mine || !lead:
	case h.awaitingHeaders > h.conns*h.streamsPerConn:
		h.streamsPerConn = (h.awaitingHeaders + h.conns - 1) / h.conns
		h.roomFoundAt = time.Now()
		h.forgetIdleBodiesLocked(idle)
	default:
		h.growAfter = min(2*h.growAfter, maxGrowWait)
		h.forgetIdleBodiesLocked(idle)
	}
}

func (h *host) forgetIdleBodiesLocked(idle bool) {
	if idle && h.conns == 1 && h.inFlight > h.awaitingHeaders {
		h.bodies.uncounted = true
		h.bodies = &bodySet{}
		h.inFlight = h.awaitingHeaders
	}
}

func (h *host) connClosed() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.conns--
	// Its streams are gone, resets pending or not; the waiting requests may
	// need the next connection.
	h.resetReadLocked(func(*cancelledPlace) bool { return true })
	h.wakeAllLocked()
}

func (h *host) setProtocolLocked(proto int32) {
	if h.proto.Swap(proto) != proto {
		h.wakeAllLocked()
	}
}

// connTrace follows one request to learn from the connection it gets.
type connTrace struct {
	h    *host
	lead bool
	got  atomic.Bool
}

func (ct *connTrace) attach(req *http.Request) *http.Request {
	return req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{GotConn: ct.gotConn}))
}

// gotConn learns the protocol ALPN chose and, over HTTP/2, the connection.
// A reused HTTP/1.1 connection tells nothing new.
func (ct *connTrace) gotConn(info httptrace.GotConnInfo) {
	proto, nc := protoHTTP1, info.Conn
	if tc, ok := nc.(*tls.Conn); ok {
		if tc.ConnectionState().NegotiatedProtocol == "h2" {
			proto = protoHTTP2
		}
		nc = tc.NetConn()
	}
	h := ct.h
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case proto == protoHTTP2:
		if c, ok := nc.(*Conn); ok {
			h.learnLocked(c, ct.lead, info.WasIdle)
		}
		h.setProtocolLocked(proto)
	case !info.Reused || h.proto.Load() == protoUnknown:
		h.setProtocolLocked(proto)
	}
	ct.doneLocked()
}

// doneLocked lets the waiting requests go: the lead has its connection, or
// gave up.
func (ct *connTrace) doneLocked() {
	if ct.got.Swap(true) || !ct.lead {
		return
	}
	ct.h.leading = false
	ct.h.wakeAllLocked()
}

// ended is called when the traced request's round trip returns. A lead that
// failed before the host's first connection, not for its own context, has
// the waiting requests go on connections of their own.
func (ct *connTrace) ended(ctx context.Context, err error) {
	h := ct.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if err != nil && ct.lead && !ct.got.Load() && ctx.Err() == nil && h.conns == 0 {
		h.leadFailures++
	}
	ct.doneLocked()
}
