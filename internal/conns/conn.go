// The http.Transports a Transports builds, as client-go builds its own, and
// the connections they dial: counted, kept for Close, refused once closed.

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
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	utilnet "k8s.io/apimachinery/pkg/util/net"
)

type dialFunc = func(ctx context.Context, network, address string) (net.Conn, error)

// newTransport builds a transport of t as client-go's cache builds its
// own (utilnet.SetTransportDefaults): HTTP/2 unless DISABLE_HTTP2 was set
// when the identity was first seen, or tlsConfig offers no h2.
func (t *Transports) newTransport(c Config, tlsConfig *tls.Config) *http.Transport {
	dial := c.Dial
	if dial == nil { // client-go's dialer for the transports it builds (transport/cache.go)
		dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	rt := &http.Transport{
		Proxy:               c.Proxy, // nil: the defaults install the environment's, as in client-go
		TLSHandshakeTimeout: 10 * time.Second,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: 25,
		DialContext:         t.dialer(dial),
		DisableCompression:  c.DisableCompression,
		DisableKeepAlives:   !c.KeepAlive,
		ProxyConnectHeader:  c.ProxyConnectHeader,
	}
	utilnet.SetOldTransportDefaults(rt)
	if !c.DisableHTTP2 {
		configureHTTP2(rt) // not utilnet.SetTransportDefaults, which reads DISABLE_HTTP2 again
	}
	rt.CloseIdleConnections() // net/http's own HTTP/2 writes NextProtos at first use: now, before rt is shared
	return rt
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

// envSeconds reads seconds as apimachinery reads its HTTP/2 health checks.
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
	c := tlsConfig.Clone()
	if c != nil && len(c.NextProtos) == 0 {
		c.NextProtos = []string{"http/1.1"}
	}
	return c
}

// ownSessions returns a copy of tlsConfig with a session cache of its own, if it has one:
// a caller may give its transport another certificate; a session is its certificate's.
func ownSessions(tlsConfig *tls.Config) *tls.Config {
	c := tlsConfig.Clone()
	if c != nil && c.ClientSessionCache != nil {
		c.ClientSessionCache = tls.NewLRUClientSessionCache(SessionCacheSize)
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

// dialer wraps dial: it counts connections, keeps them for Close, refuses
// to dial once t is closed, and stops a dial under way when t closes.
func (t *Transports) dialer(dial dialFunc) dialFunc {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		if t.isClosed() {
			return nil, t.refusal(address)
		}
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		defer context.AfterFunc(t.closing, cancel)()
		nc, err := dial(ctx, network, address)
		switch {
		case err != nil && t.isClosed():
			return nil, t.refusal(address)
		case err != nil:
			return nil, err
		}
		c := &Conn{Conn: nc, t: t}
		t.counters.Dials.Add(1)
		t.counters.Open.Add(1)
		t.mu.Lock()
		open := !t.isClosed()
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

// Conn is a connection a Transports dialed.
type Conn struct {
	net.Conn
	t      *Transports
	closed atomic.Bool
}

func (c *Conn) Close() error {
	if !c.closed.Swap(true) {
		c.t.counters.Open.Add(-1)
		c.t.mu.Lock()
		delete(c.t.conns, c)
		c.t.mu.Unlock()
	}
	return c.Conn.Close()
}
