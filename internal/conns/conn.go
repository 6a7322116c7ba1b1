// The connections a Transports dials: counted, kept so that Close can
// close them, and refused once it is closed.

package conns

import (
	"context"
	"fmt"
	"net"
	"sync"
)

// dialer wraps dial: it counts connections, keeps them so that Close can
// close them, and refuses to dial once t is closed. It dials whenever
// net/http, x/net or apimachinery (an upgrade) ask.
func (t *Transports) dialer(dial func(ctx context.Context, network, address string) (net.Conn, error)) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		if t.closed() {
			return nil, t.refusal(address)
		}
		nc, err := dial(ctx, network, address)
		if err != nil {
			return nil, err
		}
		c := &Conn{Conn: nc, set: t.conns, counters: t.counters}
		for _, n := range t.counters {
			n.Dials.Add(1)
			n.Open.Add(1)
		}
		if !t.conns.add(c) {
			c.Close() // t closed while this dial ran
			return nil, t.refusal(address)
		}
		return c, nil
	}
}

// refusal is the error of a dial t no longer makes: Close's cause, or
// ErrRetired when the drain closed t, which the caller answers by sending
// the request on the newer Transports.
func (t *Transports) refusal(address string) error {
	if cause := t.closedBy(); cause != nil {
		return fmt.Errorf("%w: dial %s", cause, address)
	}
	return fmt.Errorf("%w (dial %s)", ErrRetired, address)
}

// connSet is the connections a Transports dialed.
type connSet struct {
	mu     sync.Mutex // guards conns and closed
	conns  map[*Conn]struct{}
	closed bool
}

// add keeps c, unless the set was closed.
func (s *connSet) add(c *Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.conns[c] = struct{}{}
	}
	return !s.closed
}

func (s *connSet) remove(c *Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, c)
}

func (s *connSet) all() []*Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Conn, 0, len(s.conns))
	for c := range s.conns {
		out = append(out, c)
	}
	return out
}

// close closes the set to new connections and returns the ones it holds.
func (s *connSet) close() []*Conn {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return s.all()
}

// Conn is a connection a Transports dialed. It hides behind a *tls.Conn's
// NetConn.
type Conn struct {
	net.Conn
	set      *connSet
	counters []*Counters

	mu     sync.Mutex // guards closed and host
	closed bool
	// host is set when the connection speaks HTTP/2 and a request sent to
	// get a connection got it. Go hands such a request the first connection
	// with a free stream, not necessarily the one dialed for it, so a
	// connection counts when seen in use: a surplus one never counts.
	host *host
}

func (c *Conn) Close() error {
	c.mu.Lock()
	first := !c.closed
	c.closed = true
	h := c.host
	c.mu.Unlock()
	if first {
		for _, n := range c.counters {
			n.Open.Add(-1)
		}
		c.set.remove(c)
		if h != nil {
			h.connClosed()
		}
	}
	return c.Conn.Close()
}

// Open reports whether c has not been closed.
func (c *Conn) Open() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.closed
}

// carriesStreams reports whether c is an open HTTP/2 connection of a host.
func (c *Conn) carriesStreams() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.host != nil && !c.closed
}

// claim makes c one of h's connections. It reports whether c is new to h;
// mine reports whether c is h's (new or not).
func (c *Conn) claim(h *host) (isNew, mine bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return false, false
	case c.host == h:
		return false, true
	case c.host != nil:
		return false, false
	}
	c.host = h
	return true, true
}
