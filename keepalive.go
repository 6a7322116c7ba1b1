package sharedtransport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/transport"
	"k8s.io/client-go/util/connrotation"
)

// client-go's values for the transports it builds (transport/cache.go).
const (
	idleConnsPerHost    = 25
	tlsHandshakeTimeout = 10 * time.Second
	dialTimeout         = 30 * time.Second
	tcpKeepAlive        = 30 * time.Second
)

// generation is one identity's transport for one version of its TLS
// material. A rotation builds a new generation and swaps it in; the old one
// closes its idle connections at once and its active ones after the drain
// timeout.
type generation struct {
	transport *http.Transport
	rt        http.RoundTripper               // transport; a benchmark may swap in a no-op
	tracker   *connrotation.ConnectionTracker // every connection this generation dialed
	material  *material
	stats     *counters

	// What the generation authenticates with, for comparing with the
	// transports client-go hands the hook: the roots it trusts, and the
	// client certificate it presents (nil when none, or when it comes from
	// an exec plugin and is asked for at handshake time).
	roots *x509.CertPool
	leaf  []byte

	open atomic.Int64 // connections open now

	// Cold start: while no connection is known to work, one request goes
	// first and the others wait for its response, so a burst of first
	// requests does not dial one connection each (seed 002: 300 concurrent
	// requests opened 320 connections). Only with keep-alive on: with it off
	// every request needs its own connection anyway.
	gated  bool
	warm   atomic.Bool
	gateMu sync.Mutex    // guards leader
	leader chan struct{} // closed when the request that went first has its response
}

// newGeneration builds a transport the way client-go's tlsTransportCache
// does (transport.TLSConfigFor, utilnet.SetTransportDefaults: HTTP/2 with
// health checks, proxy environment, DISABLE_HTTP2), plus the pool's options.
// Keep-alive is set before HTTP/2 is configured: the HTTP/2 connection pool
// reads it from this transport.
func (p *Pool) newGeneration(e *entry, m *material) (*generation, error) {
	id := e.id
	tlsConfig, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{
		Insecure:      id.insecure,
		ServerName:    id.serverName,
		NextProtos:    id.nextProtos,
		CAData:        m.caPEM,
		CertData:      m.certPEM,
		KeyData:       m.keyPEM,
		GetCertHolder: id.getCert,
	}})
	if err != nil {
		return nil, err
	}
	g := &generation{
		material: m,
		stats:    &p.stats,
		tracker:  connrotation.NewConnectionTracker(),
		gated:    p.opts.keepAlive,
	}
	if tlsConfig != nil {
		g.roots = tlsConfig.RootCAs
		if len(m.certPEM) > 0 {
			cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
			if err != nil {
				return nil, err
			}
			g.leaf = cert.Certificate[0]
		}
		if p.opts.sessionResumption {
			// One cache per generation: a resumed session carries the client
			// certificate of the handshake it came from.
			tlsConfig.ClientSessionCache = tls.NewLRUClientSessionCache(p.opts.sessionCacheSz)
		}
		tlsConfig.VerifyConnection = g.countHandshake
	}

	dial := id.dial
	if dial == nil {
		dial = (&net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}).DialContext
	}
	t := &http.Transport{
		Proxy:               id.proxy, // nil: SetTransportDefaults installs the environment's proxy, like client-go
		TLSHandshakeTimeout: tlsHandshakeTimeout,
		TLSClientConfig:     tlsConfig,
		MaxIdleConnsPerHost: idleConnsPerHost,
		MaxConnsPerHost:     p.opts.maxConnsPerHost,
		DialContext:         connrotation.NewDialerWithTracker(g.countingDial(dial), g.tracker).DialContext,
		DisableCompression:  id.disableCompression,
		DisableKeepAlives:   !p.opts.keepAlive,
	}
	g.transport = utilnet.SetTransportDefaults(t)
	g.rt = g.transport
	return g, nil
}

func (g *generation) countHandshake(cs tls.ConnectionState) error {
	if cs.DidResume {
		g.stats.resumptions.Add(1)
	} else {
		g.stats.handshakes.Add(1)
	}
	return nil
}

// countingDial counts dials and open connections, closing included.
func (g *generation) countingDial(dial connrotation.DialFunc) connrotation.DialFunc {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		conn, err := dial(ctx, network, address)
		if err != nil {
			return nil, err
		}
		g.stats.dials.Add(1)
		g.stats.openConns.Add(1)
		g.open.Add(1)
		return &countedConn{Conn: conn, g: g}, nil
	}
}

type countedConn struct {
	net.Conn
	g    *generation
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() {
		c.g.stats.openConns.Add(-1)
		if c.g.open.Add(-1) == 0 {
			c.g.warm.Store(false) // the next request is a cold start again
		}
	})
	return c.Conn.Close()
}

func (g *generation) roundTrip(req *http.Request) (*http.Response, error) {
	if !g.gated || g.warm.Load() {
		return g.rt.RoundTrip(req)
	}
	return g.coldRoundTrip(req)
}

func (g *generation) coldRoundTrip(req *http.Request) (*http.Response, error) {
	g.gateMu.Lock()
	if wait := g.leader; wait != nil {
		g.gateMu.Unlock()
		select {
		case <-wait:
		case <-req.Context().Done():
			return nil, req.Context().Err()
		}
		return g.rt.RoundTrip(req)
	}
	if g.warm.Load() {
		g.gateMu.Unlock()
		return g.rt.RoundTrip(req)
	}
	done := make(chan struct{})
	g.leader = done
	g.gateMu.Unlock()

	resp, err := g.rt.RoundTrip(req)
	if err == nil && g.open.Load() > 0 {
		g.warm.Store(true)
	}
	g.gateMu.Lock()
	g.leader = nil
	g.gateMu.Unlock()
	close(done) // on failure too: the others try on their own
	return resp, err
}

// close closes every connection of the generation, active ones included.
func (g *generation) close() {
	g.transport.CloseIdleConnections()
	g.tracker.CloseAll()
}
