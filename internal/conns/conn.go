// The http.Transports a Transports builds, configured as client-go
// configures its own, and the connections they dial: counted, kept so that
// Close can close them, and refused once it is closed.

package conns

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/http2"
	utilnet "k8s.io/apimachinery/pkg/util/net"
)

// client-go's values for the transports it builds (transport/cache.go).
const (
	idleConnsPerHost    = 25
	tlsHandshakeTimeout = 10 * time.Second
	dialTimeout         = 30 * time.Second
	tcpKeepAlive        = 30 * time.Second
)

// newTransport builds a transport of t as client-go's cache builds its own.
func (t *Transports) newTransport(c Config, tlsConfig *tls.Config) *http.Transport {
	dial := c.Dial
	if dial == nil {
		dial = clientGoDialer.DialContext
	}
	rt := utilnet.SetOldTransportDefaults(&http.Transport{
		Proxy:               c.Proxy, // nil: SetOldTransportDefaults installs the environment's, like client-go
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: idleConnsPerHost,
		MaxConnsPerHost:     t.maxConns,
		DialContext:         t.dialer(dial),
		DisableCompression:  c.DisableCompression,
		DisableKeepAlives:   !c.KeepAlive,
		ProxyConnectHeader:  c.ProxyConnectHeader,
	})
	if !c.DisableHTTP2 {
		configureHTTP2(rt)
	}
	// Where net/http's own HTTP/2 serves rt, it rewrites
	// TLSClientConfig.NextProtos at first use: done now, before rt is
	// shared, so the list can be read without a race. Nothing is closed.
	rt.CloseIdleConnections()
	return rt
}

var clientGoDialer = &net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}

// speaksHTTP2 reports whether HTTP/2 was turned on for rt: x/net registers
// its own under TLSNextProto["h2"], or, where it wraps net/http's, sets
// rt.Protocols (read first: net/http writes TLSNextProto at first use).
func speaksHTTP2(rt *http.Transport) bool {
	if rt.Protocols != nil && rt.Protocols.HTTP2() {
		return true
	}
	_, ok := rt.TLSNextProto["h2"]
	return ok
}

// http1Only returns a copy of tlsConfig that offers HTTP/1.1 alone, unless
// it names protocols of its own, which are the config's to keep.
func http1Only(tlsConfig *tls.Config) *tls.Config {
	if tlsConfig == nil {
		return nil
	}
	c := tlsConfig.Clone()
	if len(c.NextProtos) == 0 {
		c.NextProtos = []string{"http/1.1"}
	}
	return c
}

// configureHTTP2 turns HTTP/2 on for rt as utilnet.SetTransportDefaults
// does, with the same health checks, but not for an ALPN list without h2.
// DISABLE_HTTP2 is left to the caller (Config.DisableHTTP2).
func configureHTTP2(rt *http.Transport) {
	if c := rt.TLSClientConfig; c != nil && len(c.NextProtos) > 0 && !slices.Contains(c.NextProtos, http2.NextProtoTLS) {
		return
	}
	t2, err := http2.ConfigureTransports(rt)
	if err != nil {
		return // SetTransportDefaults logs and goes on over HTTP/1.1
	}
	t2.ReadIdleTimeout = envSeconds("HTTP2_READ_IDLE_TIMEOUT_SECONDS", 30)
	t2.PingTimeout = envSeconds("HTTP2_PING_TIMEOUT_SECONDS", 15)
}

// envSeconds reads a duration in seconds as apimachinery reads its HTTP/2
// health-check settings: def when unset or not a number.
func envSeconds(name string, def int) time.Duration {
	n, err := strconv.Atoi(os.Getenv(name))
	if err != nil {
		n = def
	}
	return time.Duration(n) * time.Second
}

func (t *Transports) countHandshake(cs tls.ConnectionState) error {
	for _, c := range t.counters {
		if cs.DidResume {
			c.Resumptions.Add(1)
		} else {
			c.Handshakes.Add(1)
		}
	}
	return nil
}

// dialer wraps dial: it counts connections, keeps them for Close, and
// refuses to dial once t is closed.
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
// ErrRetired when the drain closed t (the request goes on the newer one).
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
	// host is set when a lead got the connection over HTTP/2. Go hands a
	// request the first connection with a free stream, not the one dialed
	// for it, so a connection counts when seen in use: a surplus one never.
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
