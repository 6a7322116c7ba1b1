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

// newTransport builds a transport of t as client-go's cache builds its
// own: HTTP/2 unless DISABLE_HTTP2 was set when the identity was first
// seen, or tlsConfig offers protocols without h2.
func (t *Transports) newTransport(c Config, tlsConfig *tls.Config) *http.Transport {
	dial := c.Dial
	if dial == nil {
		dial = clientGoDialer.DialContext
	}
	rt := &http.Transport{
		Proxy:               c.Proxy, // nil: the defaults install the environment's, as in client-go
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: idleConnsPerHost,
		DialContext:         t.dialer(dial),
		DisableCompression:  c.DisableCompression,
		DisableKeepAlives:   !c.KeepAlive,
		ProxyConnectHeader:  c.ProxyConnectHeader,
	}
	utilnet.SetOldTransportDefaults(rt)
	if !c.DisableHTTP2 {
		configureHTTP2(rt) // not utilnet.SetTransportDefaults, which reads DISABLE_HTTP2 again
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

// configureHTTP2 turns HTTP/2 on for rt as utilnet.SetTransportDefaults
// does, with the same health checks, but not for an ALPN list without h2.
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

// ownSessions returns a copy of tlsConfig with a session cache of its own,
// if it has one: a transport handed to a caller may be given another client
// certificate, and a resumed session authenticates as the one before.
func ownSessions(tlsConfig *tls.Config) *tls.Config {
	if tlsConfig == nil {
		return nil
	}
	c := tlsConfig.Clone()
	if c.ClientSessionCache != nil {
		c.ClientSessionCache = tls.NewLRUClientSessionCache(sessionCacheSize)
	}
	return c
}

func (t *Transports) countHandshake(cs tls.ConnectionState) error {
	if cs.DidResume {
		t.counters.Resumptions.Add(1)
	} else {
		t.counters.Handshakes.Add(1)
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
		c := &Conn{Conn: nc, t: t}
		t.counters.Dials.Add(1)
		t.counters.Open.Add(1)
		t.mu.Lock()
		open := !t.closed() // close closes closedCh under t.mu
		if open {
			t.conns[c] = struct{}{}
		}
		t.mu.Unlock()
		if !open {
			c.Close()
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

// Conn is a connection a Transports dialed. It hides behind a *tls.Conn's
// NetConn.
type Conn struct {
	net.Conn
	t *Transports

	mu     sync.Mutex // guards closed and host
	closed bool
	host   *host // the host a lead got it for over HTTP/2 (host.claim)
}

func (c *Conn) Close() error {
	c.mu.Lock()
	first, h := !c.closed, c.host
	c.closed = true
	c.mu.Unlock()
	if first {
		c.t.counters.Open.Add(-1)
		c.t.mu.Lock()
		delete(c.t.conns, c)
		c.t.mu.Unlock()
		if h != nil {
			h.connClosed()
		}
	}
	return c.Conn.Close()
}
