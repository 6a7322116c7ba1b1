// When a request may go to a host, and over which transport. net/http
// dials a connection per request while it has none with a free stream, and
// nothing public says when a connection is full, so a host counts its
// streams itself (docs/design.md says why the pool cannot leave it to Go).

package conns

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// firstStreams is how many streams a connection is thought to take
	// until requests show more: what Go's HTTP/2 client assumes until the
	// server's SETTINGS arrive, and kube-apiserver's default.
	firstStreams = 100

	// growWait is how long a host's HTTP/2 connections stay full, with
	// requests waiting, before one goes to get another: about a TLS
	// handshake on a busy host. maxGrowWait bounds growAfter (see host).
	growWait    = 10 * time.Millisecond
	maxGrowWait = 4 * growWait

	// loneWait is how long the connections stay full with one request
	// waiting before it goes to get another; n waiting wait loneWait/n, and
	// never less than growAfter. A new connection is worth its handshake
	// for many requests; a few are served sooner by the next stream that
	// frees, and a connection dialed for them is mostly closed as surplus
	// on arrival (Go keeps it only if every other is full at that moment).
	loneWait = 100 * time.Millisecond

	// resetHold bounds how long the place of a request cancelled after it
	// was sent stays taken when nothing shows that the server read the reset.
	resetHold = time.Second
)

type hostKey struct{ scheme, host string }

// host is one Transports' traffic to one host. A request holds a place from
// admission until its response body ends or it fails:
//
//   - While the protocol is unknown, one request goes first (the lead) and
//     the others wait for its connection, whose ALPN tells the protocol. If
//     the lead gives up before it has a connection the next one goes; if it
//     fails, the others go at once, each on a connection of its own.
//   - Over HTTP/2, requests go while the host's connections have free
//     streams by the count; when they are full for growAfter, a lead goes to
//     get another connection and the others wait for it. Under a cap they
//     wait for a stream once the cap's connections are full.
//   - Over HTTP/1.1, requests go at once, as many as the cap allows; after a
//     quiet spell the first goes alone, in case the server speaks HTTP/2 again.
type host struct {
	key      hostKey
	proto    *atomic.Int32 // shared by the identity's Transports
	shared   *http.Transport
	http1    *http.Transport
	http2    bool // shared speaks HTTP/2
	maxConns int
	closedCh <-chan struct{} // closed when the Transports close

	mu              sync.Mutex // guards every field below
	inFlight        int        // requests holding a place on shared
	awaitingHeaders int        // those of inFlight without response headers: streams the server surely holds
	admitted        uint64     // requests admitted with a place so far
	conns           int        // live HTTP/2 connections seen in use by leads
	streamsPerConn  int        // firstStreams, or more once a lead shows it
	bodies          *bodySet   // the open bodies counted in inFlight (see learnLocked)
	leading         bool       // a lead is getting the connection others wait for
	fullSince       time.Time  // when requests began to wait for a stream; zero if none waits
	// growAfter is how long the connections stay full before a lead goes
	// to get another: growWait, doubled up to maxGrowWait each time a lead
	// finds room on a connection the host had, so that a load hovering at
	// the count does not dial a surplus connection every growWait.
	// roomFoundAt is when a lead last did; zero once one got a new one.
	growAfter   time.Duration
	roomFoundAt time.Time
	queue       []chan struct{} // requests waiting for a place, in order
	woken       int             // woken from queue and yet to look again
	// cancelled are the places of requests cancelled after they were sent,
	// under a cap: Go counts such a stream until the server answers the PING
	// sent with the reset, so the place stays taken until a request admitted
	// later gets its headers, a connection closes, or resetHold passes.
	cancelled []*cancelledPlace
	// leadFailures counts the leads that failed before the host's first
	// connection: the requests waiting then go at once, each on a
	// connection of its own, as without the pool.
	leadFailures int
}

// bodySet is a set of response bodies counted in a host's inFlight.
type bodySet struct {
	uncounted bool // guarded by the host's mu
}

type cancelledPlace struct {
	after uint64 // admissions up to the cancel
	set   *bodySet
	timer *time.Timer
}

// place is where an admitted request goes and what it holds.
type place struct {
	rt      *http.Transport
	counted bool   // holds a place in inFlight until its body ends
	seq     uint64 // with counted: its number among the host's admissions
	lead    bool   // the requests waiting wait for its connection
	trace   bool   // its connection tells the protocol: trace it
	alone   bool   // after a failed lead: on a connection of its own, closed after
}

func (t *Transports) hostFor(req *http.Request) *host {
	k := hostKey{req.URL.Scheme, req.URL.Host}
	if h := t.lastHost.Load(); h != nil && h.key == k {
		return h
	}
	t.hostsMu.RLock()
	h, ok := t.hosts[k]
	t.hostsMu.RUnlock()
	if !ok {
		t.hostsMu.Lock()
		if h, ok = t.hosts[k]; !ok {
			h = &host{key: k, proto: t.protos.get(k), shared: t.shared, http1: t.http1, http2: t.http2,
				maxConns: t.maxConns, closedCh: t.closedCh, streamsPerConn: firstStreams, growAfter: growWait, bodies: &bodySet{}}
			t.hosts[k] = h
		}
		t.hostsMu.Unlock()
	}
	t.lastHost.Store(h)
	return h
}

func (h *host) protocol() int32 {
	if !h.http2 {
		return protoHTTP1
	}
	return h.proto.Load()
}

// admit returns where a request goes, waiting, bounded by ctx, while it
// must; ErrRetired when the Transports close meanwhile. Requests go in
// turn: a place that frees goes to the one that waited longest.
func (h *host) admit(ctx context.Context) (place, error) {
	deadline, _ := ctx.Deadline()
	h.mu.Lock()
	failures := h.leadFailures
	inTurn := len(h.queue) == 0 && h.woken == 0
	front := false // a woken request that finds no place keeps its turn
	for {
		if inTurn {
			if p, ok := h.tryAdmitLocked(deadline); ok {
				p.seq = h.admitted
				if front {
					h.wakeOneLocked() // the next may find a place too
				}
				h.mu.Unlock()
				return p, nil
			}
		}
		inTurn = true
		woken, err := h.waitLocked(ctx, front)
		front = woken
		if err != nil {
			h.mu.Unlock()
			return place{}, err
		}
		if h.leadFailures != failures {
			// Over http1, which dials for each request.
			h.holdLocked()
			p := place{rt: h.http1, counted: true, seq: h.admitted, alone: true}
			if front {
				h.wakeOneLocked() // one that came since may go too
			}
			h.mu.Unlock()
			return p, nil
		}
	}
}

// waitLocked queues the caller (first if front) and waits until it is woken
// or the connections have been full for growAfter. It reports whether the
// caller was woken (and so keeps its turn at the front); h.mu is held again
// when it returns.
func (h *host) waitLocked(ctx context.Context, front bool) (woken bool, err error) {
	var growC <-chan time.Time
	if !h.fullSince.IsZero() && !h.leading {
		// The caller and the queue before it joins: the count
		// tryAdmitHTTP2Locked checks, so that the caller does not wake
		// before it may lead.
		deadline, _ := ctx.Deadline()
		grow := time.NewTimer(max(h.growWaitLocked(len(h.queue)+1, deadline)-time.Since(h.fullSince), time.Nanosecond))
		defer grow.Stop()
		growC = grow.C
	}
	ready := make(chan struct{}, 1)
	if front {
		h.queue = slices.Insert(h.queue, 0, ready)
	} else {
		h.queue = append(h.queue, ready)
	}
	h.mu.Unlock()
	select {
	case <-ready:
	case <-growC:
	case <-ctx.Done():
		err = ctx.Err()
	case <-h.closedCh:
		err = ErrRetired
	}
	h.mu.Lock()
	if i := slices.Index(h.queue, ready); i >= 0 {
		h.queue = slices.Delete(h.queue, i, i+1)
		return false, err
	}
	h.woken--
	if err != nil {
		h.wakeOneLocked() // pass the wake on
	}
	return true, err
}

// tryAdmitLocked admits a request when the protocol and the connections let
// it go now.
func (h *host) tryAdmitLocked(deadline time.Time) (place, bool) {
	select {
	case <-h.closedCh:
		return place{}, false // the wait returns ErrRetired at once
	default:
	}
	switch h.protocol() {
	case protoUnknown:
		if h.leading {
			return place{}, false
		}
		return h.leadLocked(), true
	case protoHTTP2:
		return h.tryAdmitHTTP2Locked(deadline)
	default:
		return h.tryAdmitHTTP1Locked()
	}
}

func (h *host) tryAdmitHTTP2Locked(deadline time.Time) (place, bool) {
	perConn, conns := h.streamsPerConn, h.conns
	if h.maxConns > 0 {
		// A margin under a cap: a response that ends with its headers frees
		// its stream just after RoundTrip returns, and a request arriving
		// then would make net/http dial.
		perConn, conns = max(perConn*9/10, 1), min(conns, h.maxConns)
	}
	if h.inFlight < conns*perConn {
		if len(h.queue) == 0 {
			h.fullSince = time.Time{}
		}
		h.holdLocked()
		return place{rt: h.shared, counted: true}, true
	}
	if h.maxConns > 0 && h.conns >= h.maxConns || h.leading {
		return place{}, false
	}
	if h.conns > 0 && time.Since(h.roomFoundAt) >= growWait {
		// Full: streams often free up sooner than a handshake ends, and a
		// connection that comes up after that is closed as surplus.
		now := time.Now()
		if h.fullSince.IsZero() {
			h.fullSince = now
		}
		if now.Sub(h.fullSince) < h.growWaitLocked(len(h.queue)+1, deadline) {
			return place{}, false
		}
	}
	h.fullSince = time.Time{}
	return h.leadLocked(), true
}

func (h *host) tryAdmitHTTP1Locked() (place, bool) {
	if !h.http2 {
		if h.maxConns == 0 {
			return place{rt: h.shared}, true
		}
		if h.inFlight < h.maxConns {
			h.holdLocked()
			return place{rt: h.shared, counted: true}, true
		}
		return place{}, false
	}
	if h.leading || h.maxConns > 0 && h.inFlight >= h.maxConns {
		return place{}, false
	}
	// Without a cap over http1, which dials what the requests need; under
	// one over shared, which dials up to the cap.
	h.holdLocked()
	if h.inFlight > 1 {
		if h.maxConns == 0 {
			return place{rt: h.http1, counted: true}, true
		}
		return place{rt: h.shared, counted: true, trace: true}, true
	}
	h.leading = true
	return place{rt: h.shared, counted: true, lead: true, trace: true}, true
}

// growWaitLocked is how long the connections stay full, with waiting
// requests waiting, before a lead goes to get another (see loneWait). A
// request due sooner goes a quarter of the way to its deadline, so that
// the wait leaves it the time a new connection needs.
func (h *host) growWaitLocked(waiting int, deadline time.Time) time.Duration {
	wait := loneWait / time.Duration(max(waiting, 1))
	if !deadline.IsZero() {
		wait = min(wait, deadline.Sub(h.fullSince)/4)
	}
	return max(h.growAfter, wait)
}

func (h *host) leadLocked() place {
	h.leading = true
	h.holdLocked()
	return place{rt: h.shared, counted: true, lead: true, trace: true}
}

func (h *host) holdLocked() {
	h.inFlight++
	h.awaitingHeaders++
	h.admitted++
}

// answered ends a request's wait for its headers, which show that the
// server read every reset sent before it was admitted (seq), and returns the
// set its body is counted in; a failed request lets go of its place.
func (h *host) answered(seq uint64, failed bool) *bodySet {
	h.mu.Lock()
	h.awaitingHeaders--
	set := h.bodies
	if !failed {
		h.resetReadLocked(func(c *cancelledPlace) bool { return c.after < seq })
	}
	h.mu.Unlock()
	if failed {
		h.release(set)
	}
	return set
}

// cancel ends the wait of a request whose context ended after it was sent,
// under a cap over HTTP/2: its place stays taken (see host.cancelled).
func (h *host) cancel() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.awaitingHeaders--
	c := &cancelledPlace{after: h.admitted, set: h.bodies}
	c.timer = time.AfterFunc(resetHold, func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.resetReadLocked(func(o *cancelledPlace) bool { return o == c })
	})
	h.cancelled = append(h.cancelled, c)
}

// resetReadLocked frees the cancelled places whose reset read reports the
// server has read.
func (h *host) resetReadLocked(read func(*cancelledPlace) bool) {
	h.cancelled = slices.DeleteFunc(h.cancelled, func(c *cancelledPlace) bool {
		if !read(c) {
			return false
		}
		c.timer.Stop()
		if !c.set.uncounted {
			h.inFlight--
		}
		h.wakeOneLocked()
		return true
	})
}

// release ends the place of a response body of set.
func (h *host) release(set *bodySet) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !set.uncounted {
		h.inFlight--
	}
	h.wakeOneLocked()
}

func (h *host) wakeOneLocked() {
	if len(h.queue) > 0 {
		h.queue[0] <- struct{}{}
		h.queue = slices.Delete(h.queue, 0, 1)
		h.woken++
	}
}

func (h *host) wakeAllLocked() {
	for _, w := range h.queue {
		w <- struct{}{}
	}
	h.woken += len(h.queue)
	h.queue = h.queue[:0]
}
