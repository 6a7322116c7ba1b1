// How a generation sends requests to a host: a cold-start gate that lets
// the first request learn the host's protocol while the others wait for its
// connection, and a stream limiter that keeps an HTTP/2 burst to the
// connections it needs (and to WithMaxConnsPerHost). A request holds its
// place until its response body ends (bodies.go).

package sharedtransport

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/util/httpstream"
)

const (
	// firstStreams is how many streams the pool expects a connection to
	// take until the connection shows otherwise: what Go's HTTP/2 client
	// itself assumes until the server's SETTINGS arrive, and
	// kube-apiserver's default (--http2-max-streams-per-connection).
	firstStreams = 100

	// growWait is how long a host's HTTP/2 connections stay full, with
	// requests waiting, before one of them goes to get another connection:
	// about a TLS handshake on a busy host.
	growWait = 10 * time.Millisecond

	// maxPatience bounds how long a host's connections may stay full before
	// one more is got, once leads kept finding room on the connections the
	// host had (see learnLocked).
	maxPatience = 4 * growWait
)

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

// names lists the hosts in t as URLs without paths, sorted.
func (t *hostTable) names() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.hosts) == 0 {
		return nil
	}
	out := make([]string, 0, len(t.hosts))
	for k := range t.hosts {
		out = append(out, k.scheme+"://"+k.host)
	}
	slices.Sort(out)
	return out
}

// hostConns is one generation's traffic to one host. It decides, for every
// request but upgrades, which transport sends it and when:
//
//   - While the protocol is unknown, one request goes first and the others
//     wait for its connection (not its response): ALPN tells the protocol
//     when the handshake ends. If it gives up (its context) before it has
//     a connection, the next waiter goes; if it fails, they all go at once,
//     each on a connection of its own.
//   - Over HTTP/2, requests go out while the connections the host is known
//     to have leave streams free by the count (hc.streams each, learnt
//     from the connections); beyond that, after growWait, one request goes
//     to get the next connection and the others wait for it, so a burst
//     opens about one connection per server stream limit. With a cap they
//     wait for a stream instead once the cap's connections are full.
//   - Over HTTP/1.1, requests go out at once, as many as the cap allows,
//     each on an idle connection or a new one: without a cap over http1,
//     under one over the transport that offers HTTP/2, so that the pool
//     sees when the server speaks it again. When none is in flight (a
//     server back after a failover) the first goes alone over the latter
//     until it has its connection.
//
// A request holds its place from admission until its response body ends
// (EOF or Close, after which Go has freed the stream) or it fails; one
// cancelled after it was sent, under a cap, until the server has read the
// reset (see resetting).
type hostConns struct {
	g     *generation
	key   hostKey
	proto *atomic.Int32 // shared with the identity's other generations

	mu       sync.Mutex // guards the fields below
	inflight int        // requests on g.transport, from admission until their body ends
	conns    int        // live HTTP/2 connections seen in use by requests sent to get one
	// streams is how many streams a connection of the host is thought to
	// take: firstStreams, and then what requests sent to get a
	// connection found (see learnLocked).
	streams int
	// roomAt is when a request sent to get a connection last found room on
	// one the host had for more requests awaiting their headers than the
	// count allowed; zero once one got a new connection.
	roomAt time.Time
	// awaiting counts the requests of inflight whose response headers have
	// not come: streams the server has for certain, unlike a response
	// whose body is still to be read or closed, which the server may have
	// ended.
	awaiting int
	// holds is the set the response bodies counted in inflight belong to;
	// a new one when they are found to hold no stream (see learnLocked).
	holds   *holdSet
	leading bool // a request is getting the connection the waiters wait for
	// fullSince is when requests began to wait for a stream on the
	// host's HTTP/2 connections; zero when none waits.
	fullSince time.Time
	// patience is how long the connections stay full before a request goes
	// to get another: growWait, doubled (up to maxPatience) each time such a
	// request found room on one the host had instead, so that a load that
	// hovers at the count does not have a connection dialed, and closed as
	// surplus, every growWait.
	patience time.Duration
	waiters  []chan struct{}
	woken    int // waiters woken that have not looked again yet
	// admitted numbers the requests admitted with a place, in order.
	admitted uint64
	// resetting are the places of requests cancelled after they were sent,
	// under a cap: Go's HTTP/2 client counts such a stream against its
	// connection until the server answers the PING it sends with the
	// reset, so the place stays taken until a request admitted after the
	// cancel gets its headers (the server has read the reset by then), a
	// connection of the host closes, or resetHold passes.
	resetting []*resetPlace
	// failed changes when a request that went to get the host's only
	// connection fails before it has one: the requests waiting for that
	// connection then go at once, each on a connection of its own, as they
	// would without the pool, instead of one after the other.
	failed *leadFailure
}

type leadFailure struct{}

// holdSet is a set of response bodies counted in a host's inflight.
type holdSet struct {
	forgiven bool // no longer counted; guarded by the host's mu
}

// admission is where a request goes and what it holds.
type admission struct {
	rt   *http.Transport
	slot bool   // counted in inflight until its body ends
	seq  uint64 // with slot: its number among the host's admissions
	lead bool   // the waiters wait for its connection
	look bool   // its connection tells the protocol: trace it
}

// resetHold bounds how long the place of a cancelled request stays taken
// when nothing shows that the server read the reset.
const resetHold = time.Second

// resetPlace is the place of a request cancelled after it was sent.
type resetPlace struct {
	after uint64 // the admissions up to the cancel
	set   *holdSet
	timer *time.Timer
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
			hc = &hostConns{g: g, proto: g.known.get(k), key: k, streams: firstStreams, patience: growWait, holds: &holdSet{}}
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
//
// Waiters go in turn: a request that comes while others wait, or are woken
// and yet to look, goes behind them. A place that frees goes to the request
// that waited longest, not to the next request of a client whose last one
// just ended, which would leave the waiter to find the connections full
// until growWait and have a connection dialed that the freed places made
// surplus.
func (hc *hostConns) admit(ctx context.Context) (admission, error) {
	hc.mu.Lock()
	failed := hc.failed
	inTurn := len(hc.waiters) == 0 && hc.woken == 0
	front := false // a woken waiter that finds no place keeps its turn
	for {
		if inTurn {
			if a, ok := hc.tryAdmitLocked(); ok {
				a.seq = hc.admitted
				if front {
					hc.wakeOneLocked() // the next may find a place too
				}
				hc.mu.Unlock()
				return a, nil
			}
		}
		inTurn = true
		ready := make(chan struct{}, 1)
		if front {
			hc.waiters = slices.Insert(hc.waiters, 0, ready)
		} else {
			hc.waiters = append(hc.waiters, ready)
		}
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
		front = false
		if i := slices.Index(hc.waiters, ready); i >= 0 {
			hc.waiters = slices.Delete(hc.waiters, i, i+1)
		} else {
			hc.woken--
			front = true
			if err != nil {
				hc.wakeOneLocked() // pass it on
			}
		}
		if err != nil {
			hc.mu.Unlock()
			return admission{}, err
		}
		if hc.failed != failed {
			// Over http1, which dials for each: the HTTP/2 transport dials
			// one at a time. Not looked at: an HTTP/1.1 connection offered
			// nothing else.
			hc.holdLocked()
			a := admission{rt: hc.g.http1, slot: true, seq: hc.admitted}
			if front {
				hc.wakeOneLocked() // one that came since may go too
			}
			hc.mu.Unlock()
			return a, nil
		}
	}
}

// growDelayLocked is how long the host's connections have yet to stay full
// before a request goes to get another one (see tryAdmitHTTP2Locked), or 0.
func (hc *hostConns) growDelayLocked() time.Duration {
	if hc.fullSince.IsZero() || hc.leading {
		return 0
	}
	return max(hc.patience-time.Since(hc.fullSince), time.Nanosecond)
}

// tryAdmitLocked admits a request when the host's protocol and connections
// let it go now.
func (hc *hostConns) tryAdmitLocked() (admission, bool) {
	if hc.g.shut.Load() {
		return admission{}, false // the caller's wait returns errRetired at once
	}
	switch hc.protocol() {
	case protoUnknown:
		if hc.leading {
			return admission{}, false
		}
		return hc.leadLocked(), true
	case protoHTTP2:
		return hc.tryAdmitHTTP2Locked()
	default:
		return hc.tryAdmitHTTP1Locked()
	}
}

// tryAdmitHTTP2Locked admits a request while the host's HTTP/2 connections
// have a free stream, or as the one that gets the next connection.
func (hc *hostConns) tryAdmitHTTP2Locked() (admission, bool) {
	g := hc.g
	perConn, conns := hc.streams, hc.conns
	if g.maxConns > 0 {
		// A margin under a cap: a response that ends with its headers
		// frees its stream just after RoundTrip returns, and a request
		// arriving then would find none free and make net/http dial.
		perConn, conns = max(perConn*9/10, 1), min(conns, g.maxConns)
	}
	if hc.inflight < conns*perConn {
		if len(hc.waiters) == 0 {
			hc.fullSince = time.Time{}
		}
		hc.holdLocked()
		return admission{rt: g.transport, slot: true}, true
	}
	if g.maxConns > 0 && hc.conns >= g.maxConns || hc.leading {
		return admission{}, false
	}
	if hc.conns > 0 && time.Since(hc.roomAt) >= growWait {
		// Full: streams often free up sooner than a handshake ends (a
		// burst of short lists), and a connection that comes up after
		// that is closed as surplus. Another one is got when the
		// connections have stayed full for growWait; at once while the
		// last request sent for one found room instead.
		now := time.Now()
		if hc.fullSince.IsZero() {
			hc.fullSince = now
		}
		if now.Sub(hc.fullSince) < hc.patience {
			return admission{}, false
		}
	}
	hc.fullSince = time.Time{}
	return hc.leadLocked(), true
}

// tryAdmitHTTP1Locked admits a request to a host that speaks HTTP/1.1 (or
// over a transport that does not speak HTTP/2) while the cap allows.
func (hc *hostConns) tryAdmitHTTP1Locked() (admission, bool) {
	g := hc.g
	if !g.http2 {
		if g.maxConns == 0 {
			return admission{rt: g.transport}, true
		}
		if hc.inflight < g.maxConns {
			hc.holdLocked()
			return admission{rt: g.transport, slot: true}, true
		}
		return admission{}, false
	}
	if hc.leading || g.maxConns > 0 && hc.inflight >= g.maxConns {
		return admission{}, false
	}
	// When nothing is in flight (a host back after a failover, say), the
	// first request goes alone over the transport that offers HTTP/2, and
	// the others wait for its connection: if it speaks HTTP/2 they go there
	// too. Otherwise, without a cap, requests go over http1, which dials as
	// many connections as they need (the HTTP/2 transport dials one at a
	// time); under a cap the HTTP/2 transport dials up to the cap.
	hc.holdLocked()
	if hc.inflight > 1 {
		if g.maxConns == 0 {
			return admission{rt: g.http1, slot: true}, true
		}
		return admission{rt: g.transport, slot: true, look: true}, true
	}
	hc.leading = true
	return admission{rt: g.transport, slot: true, lead: true, look: true}, true
}

// leadLocked admits a request as the one that gets the connection the
// waiters wait for.
func (hc *hostConns) leadLocked() admission {
	hc.leading = true
	hc.holdLocked()
	return admission{rt: hc.g.transport, slot: true, lead: true, look: true}
}

// holdLocked counts an admitted request until its response body ends.
func (hc *hostConns) holdLocked() {
	hc.inflight++
	hc.awaiting++
	hc.admitted++
}

// answered ends the wait of an admitted request for its headers and returns
// the holds its body is counted in; failed, the request lets go of its hold.
// Its headers show that the server read every reset sent before it was
// admitted (seq).
func (hc *hostConns) answered(seq uint64, failed bool) *holdSet {
	hc.mu.Lock()
	hc.awaiting--
	set := hc.holds
	if !failed {
		hc.resetReadLocked(func(r *resetPlace) bool { return r.after < seq })
	}
	hc.mu.Unlock()
	if failed {
		hc.release(set)
	}
	return set
}

// cancelled ends the wait of an admitted request that its context ended
// after it was sent, under a cap over HTTP/2: its place stays taken until
// the server has read the reset (see resetting).
func (hc *hostConns) cancelled() {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	hc.awaiting--
	r := &resetPlace{after: hc.admitted, set: hc.holds}
	r.timer = time.AfterFunc(resetHold, func() {
		hc.mu.Lock()
		defer hc.mu.Unlock()
		hc.resetReadLocked(func(o *resetPlace) bool { return o == r })
	})
	hc.resetting = append(hc.resetting, r)
}

// resetReadLocked frees the places of resetting that read reports the
// server has read.
func (hc *hostConns) resetReadLocked(read func(*resetPlace) bool) {
	hc.resetting = slices.DeleteFunc(hc.resetting, func(r *resetPlace) bool {
		if !read(r) {
			return false
		}
		r.timer.Stop()
		if !r.set.forgiven {
			hc.inflight--
		}
		hc.wakeOneLocked()
		return true
	})
}

func (hc *hostConns) wakeOneLocked() {
	if len(hc.waiters) > 0 {
		hc.waiters[0] <- struct{}{}
		hc.waiters = slices.Delete(hc.waiters, 0, 1)
		hc.woken++
	}
}

func (hc *hostConns) wakeAllLocked() {
	for _, w := range hc.waiters {
		w <- struct{}{}
	}
	hc.woken += len(hc.waiters)
	hc.waiters = hc.waiters[:0]
}

// release ends the hold of a response body of set.
func (hc *hostConns) release(set *holdSet) {
	hc.mu.Lock()
	if !set.forgiven {
		hc.inflight--
	}
	hc.wakeOneLocked()
	hc.mu.Unlock()
	if hc.g.retired.Load() {
		hc.g.closeIdleSoon()
	}
}

// learnLocked learns from c, the HTTP/2 connection a traced request got. A
// new one counts among the host's connections. When the request went to get
// one because the others were full by the count (lead), the connection Go
// gave it says how good the count was. A new one: the count held (what the
// count was when the request went is all the connections show, so it is
// left as it is). One of the host's own: they had room the count did not
// see.
//
//   - More requests await their headers than the count allowed: the
//     server allows more streams. A connection is thought to take as many,
//     and the next request waiting goes the same way at once, so that Go
//     places them one by one while there is room.
//   - The host's one connection had no stream at all (idle): the bodies
//     counted, neither read to their end nor closed, hold none; the server
//     ended their streams. They are no longer counted.
//   - Otherwise the room may be streams the server ended whose bodies are
//     about to be read (a burst's short lists): the count stands, and the
//     next request goes to get a connection only after growWait.
func (hc *hostConns) learnLocked(c *countedConn, lead, idle bool) {
	switch c.countFor(hc) {
	case countedNow:
		hc.conns++
		hc.roomAt = time.Time{}
		hc.patience = growWait
		hc.wakeAllLocked()
	case countedBefore:
		if !lead {
			return
		}
		if hc.awaiting > hc.conns*hc.streams {
			hc.streams = (hc.awaiting + hc.conns - 1) / hc.conns
			hc.roomAt = time.Now()
		} else {
			hc.patience = min(2*hc.patience, maxPatience)
		}
		if idle && hc.conns == 1 && hc.inflight > hc.awaiting {
			hc.holds.forgiven = true
			hc.holds = &holdSet{}
			hc.inflight = hc.awaiting
		}
	}
}

func (hc *hostConns) connClosed() {
	hc.mu.Lock()
	hc.conns--
	// Its streams are gone, resets pending or not; the waiters may have
	// to get the next connection.
	hc.resetReadLocked(func(*resetPlace) bool { return true })
	hc.wakeAllLocked()
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

func (l *look) trace(req *http.Request) *http.Request {
	return req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{GotConn: l.gotConn}))
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
			hc.learnLocked(conn, l.lead, info.WasIdle)
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

// ended is called when the request's round trip returns, with err if it failed.
// A request that went to get the host's only connection and failed before it
// had one, not for its own context, fails its waiters with it.
func (l *look) ended(ctx context.Context, err error) {
	hc := l.hc
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if err != nil && l.lead && !l.got.Load() && ctx.Err() == nil && hc.conns == 0 {
		hc.failed = &leadFailure{}
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
		resp.Body = wrapBody(resp.Body, l, nil, nil, false)
		return resp, nil
	}
	hc := g.hostFor(req)
	// Counted from before admission, so that a generation yielding the cap
	// never closes its connections under a request it is admitting.
	busy := g.maxConns > 0 && !longRunning(req)
	if busy {
		g.busy.Add(1)
	}
	a, err := hc.admit(req.Context())
	if busy && (err != nil || !a.slot) { // a body with a slot ends it
		g.doneBusy()
		busy = false
	}
	if err != nil {
		return nil, err
	}
	if g.maxConns > 0 && a.lead {
		g.owner.yieldCap(g) // it may dial
	}
	sent := req
	var lk *look
	if a.look {
		lk = &look{hc: hc, lead: a.lead}
		sent = lk.trace(req)
	}
	resp, err := a.rt.RoundTrip(sent)
	if lk != nil {
		lk.ended(req.Context(), err)
	}
	var set *holdSet
	switch {
	case a.slot && err != nil && req.Context().Err() != nil && g.maxConns > 0 && a.rt == g.transport && hc.protocol() == protoHTTP2:
		hc.cancelled()
	case a.slot:
		set = hc.answered(a.seq, err != nil)
	}
	if err != nil {
		if busy {
			g.doneBusy()
		}
		return nil, err
	}
	resp.Request = req
	if !a.slot {
		hc = nil
	}
	resp.Body = wrapBody(resp.Body, l, hc, set, busy)
	return resp, nil
}

// longRunning reports whether req asks the API server for a stream that
// runs until one side ends it: a watch, a followed log.
func longRunning(req *http.Request) bool {
	raw := req.URL.RawQuery
	if !strings.Contains(raw, "watch") && !strings.Contains(raw, "follow") {
		return false // most requests: no query to parse
	}
	q := req.URL.Query()
	for _, k := range []string{"watch", "follow"} {
		if v := q.Get(k); v == "true" || v == "1" {
			return true
		}
	}
	return false
}
