// What an identity knows about the hosts it talks to, shared by its
// generations: the protocol each speaks, and, under WithMaxConnsPerHost, the
// identity's connections to each, which the cap counts across rotations.

package sharedtransport

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
)

// What an identity knows about a host: the protocol its server spoke on the
// last new connection (ALPN, at the end of the handshake). It is kept per
// host, because one identity's hosts can differ, and shared by the
// identity's generations, because a rotation changes the client's
// certificate, not the server.
const (
	protoUnknown int32 = iota
	protoHTTP2
	protoHTTP1
)

type hostKey struct{ scheme, host string }

// hostInfo is what an identity knows about one host, and, under a cap, its
// connections to it.
type hostInfo struct {
	proto atomic.Int32

	mu      sync.Mutex // guards conns, dialing and freed
	conns   map[*countedConn]struct{}
	dialing int           // dials the cap let go that have no connection yet
	freed   chan struct{} // closed when one of conns closes or a dial fails; nil: none waits
}

type hostTable struct {
	mu    sync.Mutex // guards hosts
	hosts map[hostKey]*hostInfo
}

func (t *hostTable) get(k hostKey) *hostInfo {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.hosts == nil {
		t.hosts = map[hostKey]*hostInfo{}
	}
	h, ok := t.hosts[k]
	if !ok {
		h = &hostInfo{conns: map[*countedConn]struct{}{}}
		t.hosts[k] = h
	}
	return h
}

// names lists the hosts in t as URLs without paths, sorted.
func (t *hostTable) names() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.hosts))
	for k := range t.hosts {
		out = append(out, k.scheme+"://"+k.host)
	}
	slices.Sort(out)
	return out
}

// makeRoom returns once g may dial one more connection to the host under
// its cap. Connections of retired generations make room by closing: the
// identity's traffic moved to the new material, and the cap is the
// identity's. g's own connections count while they are not HTTP/2: an
// HTTP/2 connection takes no new streams once it received GOAWAY, and under
// a cap x/net dials for the host only when its connection takes none
// (StrictMaxConcurrentStreams). Over HTTP/1.1, a request whose dial waits
// here gets the first connection that turns idle from net/http.
func (h *hostInfo) makeRoom(ctx context.Context, g *generation) error {
	for {
		h.mu.Lock()
		var retired []*countedConn
		n := h.dialing
		http2 := h.proto.Load() == protoHTTP2
		for c := range h.conns {
			if c.g != g && c.g.retired.Load() {
				retired = append(retired, c)
			} else if c.g == g && !http2 && !c.h2.Load() {
				n++
			}
		}
		if n+len(retired) < g.maxConns {
			h.dialing++
			h.mu.Unlock()
			return nil
		}
		if len(retired) > 0 {
			h.mu.Unlock()
			for _, c := range retired[:min(len(retired), n+len(retired)-g.maxConns+1)] {
				c.Close()
			}
			continue
		}
		if h.freed == nil {
			h.freed = make(chan struct{})
		}
		freed := h.freed
		h.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			return ctx.Err()
		case <-g.shutCh:
			return g.refusal("")
		}
	}
}

// admitted ends a dial makeRoom let go: c is its connection, nil when it
// failed.
func (h *hostInfo) admitted(c *countedConn) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dialing--
	if c != nil {
		h.conns[c] = struct{}{}
	} else {
		h.signalLocked()
	}
}

func (h *hostInfo) remove(c *countedConn) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.conns, c)
	h.signalLocked()
}

func (h *hostInfo) signalLocked() {
	if h.freed != nil {
		close(h.freed)
		h.freed = nil
	}
}
