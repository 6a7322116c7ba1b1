// What an identity knows of a host's protocol, and the cold start: net/http
// dials a connection for every request waiting while a host has none, so
// while the protocol is unknown one request goes first (the lead) and the
// others wait for its connection, whose ALPN tells the protocol; never for
// its response.

package conns

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"sync/atomic"
)

const (
	protoUnknown int32 = iota
	protoHTTP2         // a lead's connection spoke h2, and one such is open
	protoHTTP1         // a connection of shared spoke HTTP/1.1
)

type hostKey struct{ scheme, host string }

// hosts is what an identity knows of the servers it talks to, shared by
// its Transports: a rotation changes the client, not the server.
type hosts struct{ byKey sync.Map } // hostKey -> *host

func (hs *hosts) get(req *http.Request) *host {
	k := hostKey{req.URL.Scheme, req.URL.Host}
	if h, ok := hs.byKey.Load(k); ok {
		return h.(*host)
	}
	h, _ := hs.byKey.LoadOrStore(k, &host{})
	return h.(*host)
}

func (hs *hosts) names() []string {
	var out []string
	hs.byKey.Range(func(k, _ any) bool {
		out = append(out, k.(hostKey).scheme+"://"+k.(hostKey).host)
		return true
	})
	slices.Sort(out)
	return out
}

// host is one server an identity talks to. HTTP/2 is known while a
// connection a lead got over it is open: a server that went away may come
// back speaking HTTP/1.1, which shared would serialize. HTTP/1.1 is known
// until a response over HTTP/2 shows otherwise.
type host struct {
	proto atomic.Int32 // written under mu, read without it
	// onShared is the request that may be on shared's one connection to
	// the host over HTTP/1.1 (a lead, or a request to an HTTP/1.1 host):
	// the next goes over shared once it ended, reusing the connection as
	// client-go would, and over open while it runs.
	onShared atomic.Pointer[turn]

	mu    sync.Mutex // guards lead, conns and the writes of proto
	lead  *lead      // the request getting the first connection; nil if none
	conns int        // open connections leads got over HTTP/2
}

// turn is a request's hold on shared's HTTP/1.1 connection to a host.
type turn struct{ h *host }

// release lets the next request have the connection; t may be nil.
func (t *turn) release() {
	if t != nil {
		t.h.onShared.CompareAndSwap(t, nil)
	}
}

// lead is a request getting a host's first connection.
type lead struct {
	turn *turn         // its hold on shared, nil when it went over open
	done chan struct{} // closed when it has its connection, or has ended without one
	// failed is written before done is closed: the lead failed, not for
	// its own context or a retirement, so the requests waiting go at once,
	// each on a connection of its own, as without the pool.
	failed bool
}

// way is how one request goes to its host: over shared unless open or
// alone.
type way struct {
	open  bool
	alone bool  // after a failed lead: over http1, its connection closed after
	turn  *turn // holds shared's HTTP/1.1 connection until the request ends
	lead  *lead // its connection tells the protocol
}

// route returns the way of a request to h, waiting, bounded by ctx, for
// the lead's connection while the protocol is unknown; ErrRetired when
// closed is closed meanwhile.
func (h *host) route(ctx context.Context, closed <-chan struct{}) (way, error) {
	for {
		switch h.proto.Load() {
		case protoHTTP2:
			return way{}, nil
		case protoHTTP1:
			return h.sharedIfFree(), nil
		}
		h.mu.Lock()
		l := h.lead
		if l == nil && h.proto.Load() == protoUnknown {
			w := h.sharedIfFree()
			w.lead = &lead{turn: w.turn, done: make(chan struct{})}
			h.lead = w.lead
			h.mu.Unlock()
			return w, nil
		}
		h.mu.Unlock()
		if l == nil {
			continue // the protocol was learned meanwhile
		}
		select {
		case <-l.done:
			if l.failed {
				return way{alone: true}, nil
			}
			// It has its connection, or gave up: the next request leads.
		case <-ctx.Done():
			return way{}, ctx.Err()
		case <-closed:
			return way{}, ErrRetired
		}
	}
}

// sharedIfFree is the way over shared, holding its HTTP/1.1 connection,
// while no other request holds it; over open otherwise.
func (h *host) sharedIfFree() way {
	if t := (&turn{h: h}); h.onShared.CompareAndSwap(nil, t) {
		return way{turn: t}
	}
	return way{open: true}
}

// end ends l; the requests waiting for it go on. c, if set, is the
// connection it got, which tells the protocol.
func (h *host) end(l *lead, c net.Conn, failed bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case c == nil:
	case !isHTTP2(c):
		h.proto.Store(protoHTTP1)
	case h.claim(c):
		h.proto.Store(protoHTTP2)
		l.turn.release() // a stream, not the connection
	}
	if h.lead != l {
		return // ended already
	}
	h.lead = nil
	l.failed = failed
	close(l.done)
}

func isHTTP2(c net.Conn) bool {
	tc, ok := c.(*tls.Conn)
	return ok && tc.ConnectionState().NegotiatedProtocol == "h2"
}

// claim counts c, a lead's HTTP/2 connection, among h's; false if it
// closed meanwhile.
func (h *host) claim(c net.Conn) bool {
	for {
		switch nc := c.(type) {
		case *tls.Conn: // the server's, or a proxy's
			c = nc.NetConn()
			continue
		case *Conn:
			nc.mu.Lock()
			defer nc.mu.Unlock()
			if nc.closed {
				return false
			}
			if nc.host == nil {
				nc.host = h
				h.conns++
			}
		}
		return true
	}
}

// connClosed is called when a connection counted among h's closes.
func (h *host) connClosed() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.conns--; h.conns == 0 {
		h.proto.CompareAndSwap(protoHTTP2, protoUnknown)
	}
}

// answered learns from a response that came the way w over the given
// protocol, and returns the turn its body holds. A response over HTTP/2
// holds none, and to an HTTP/1.1 host has the next request lead. One over
// HTTP/1.1 on a new connection of shared makes the host an HTTP/1.1 host,
// the request holding the connection when it can.
func (h *host) answered(w way, protoMajor int) *turn {
	if protoMajor == 2 {
		w.turn.release()
		if h.proto.Load() == protoHTTP1 {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.proto.CompareAndSwap(protoHTTP1, protoUnknown)
		}
		return nil
	}
	if !w.open && !w.alone && w.turn == nil && w.lead == nil {
		w = h.sharedIfFree()
		h.mu.Lock()
		defer h.mu.Unlock()
		h.proto.Store(protoHTTP1)
	}
	return w.turn
}

// traceLead returns req traced so that h learns the protocol from the
// connection the lead l gets.
func (h *host) traceLead(req *http.Request, l *lead) *http.Request {
	gotConn := func(info httptrace.GotConnInfo) { h.end(l, info.Conn, false) }
	return req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{GotConn: gotConn}))
}

// leadEnded ends l when its round trip returned without a connection: it
// failed unless its own context or a retirement stopped it.
func (h *host) leadEnded(ctx context.Context, l *lead, err error) {
	h.end(l, nil, err != nil && ctx.Err() == nil && !errors.Is(err, ErrRetired))
}
