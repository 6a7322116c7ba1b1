package sharedtransport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
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
	// streamsPerConn is kube-apiserver's default HTTP/2 stream limit
	// (--http2-max-streams-per-connection, 100 since v1.25).
	streamsPerConn = 100
	// streamsInFlight leaves a margin under it: a stream whose response body
	// was closed is still counted by the connection for a moment, and a
	// request arriving then would make Go dial a connection beyond the cap.
	streamsInFlight = streamsPerConn * 9 / 10

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
	// transport is built for HTTP/2 with MaxConnsPerHost 1: over HTTP/2 that
	// bounds connections being dialed at once, not the total, so a burst of
	// N concurrent requests opens ceil(N/streams) connections instead of N
	// (seed 002: 300 requests opened 320 connections without it). Over
	// HTTP/1.1 the same setting would serialize every request on one
	// connection, so requests go to http1 instead until a response shows the
	// server speaks HTTP/2.
	transport *http.Transport
	http1     *http.Transport
	choice    atomic.Pointer[choice]          // nil until the protocol is known
	tracker   *connrotation.ConnectionTracker // every connection this generation dialed
	closed    atomic.Bool
	material  *material
	stats     *counters

	// What the generation authenticates with, for comparing with the
	// transports client-go hands the hook: the roots it trusts, and the
	// client certificate it presents (nil when none, or when it comes from
	// an exec plugin and is asked for at handshake time).
	roots *x509.CertPool
	leaf  []byte

	// streams, when the pool caps connections, holds a slot per request in
	// flight over HTTP/2: with at most cap x streamsInFlight requests on the
	// wire, Go never needs more than cap connections, and the rest wait for
	// a slot (bounded by their context) instead of dialing. x/net's own
	// StrictMaxConcurrentStreams would do this per connection, but through
	// net/http's transport it stalled here (x/net v0.45 and v0.57: 500
	// requests, 101 served, the rest waited until their deadline).
	streams chan struct{}

	gateMu sync.Mutex    // guards leader
	leader chan struct{} // closed when the request that went first has its response
}

// choice is the round tripper requests use once the protocol is known.
type choice struct {
	rt      http.RoundTripper
	isHTTP2 bool
}

// newGeneration builds transports the way client-go's tlsTransportCache
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
	}
	var http1TLS *tls.Config
	if tlsConfig != nil {
		g.roots = tlsConfig.RootCAs
		if len(m.certPEM) > 0 {
			cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
			if err != nil {
				return nil, err
			}
			g.leaf = cert.Certificate[0]
		}
		if p.opts.sessionResumption && id.getCert == nil {
			// One cache per generation: a resumed session carries the client
			// certificate of the handshake it came from. An exec plugin's
			// certificate can change without a new generation, and a resumed
			// session would go on authenticating as the old one, so such
			// identities do not resume.
			tlsConfig.ClientSessionCache = tls.NewLRUClientSessionCache(p.opts.sessionCacheSz)
		}
		tlsConfig.VerifyConnection = g.countHandshake
		http1TLS = tlsConfig.Clone()
		if len(id.nextProtos) == 0 {
			http1TLS.NextProtos = []string{"http/1.1"}
		}
	}

	dial := id.dial
	if dial == nil {
		dial = (&net.Dialer{Timeout: dialTimeout, KeepAlive: tcpKeepAlive}).DialContext
	}
	tracked := connrotation.NewDialerWithTracker(g.countingDial(dial), g.tracker).DialContext
	dial = func(ctx context.Context, network, address string) (net.Conn, error) {
		conn, err := tracked(ctx, network, address)
		// A request that passed the closed check just before close may
		// dial after it. closed is set before the tracker closes its
		// connections, so a connection tracked too late is caught here.
		if err == nil && g.closed.Load() {
			conn.Close()
			return nil, fmt.Errorf("%w: dial %s", ErrClosed, address)
		}
		return conn, err
	}
	build := func(tlsConfig *tls.Config, maxConns int) *http.Transport {
		t := &http.Transport{
			Proxy:               id.proxy, // nil: SetTransportDefaults installs the environment's proxy, like client-go
			TLSHandshakeTimeout: tlsHandshakeTimeout,
			TLSClientConfig:     tlsConfig,
			MaxIdleConnsPerHost: idleConnsPerHost,
			MaxConnsPerHost:     maxConns,
			DialContext:         dial,
			DisableCompression:  id.disableCompression,
			DisableKeepAlives:   !p.opts.keepAlive,
			ProxyConnectHeader:  id.connectHeader,
		}
		return utilnet.SetTransportDefaults(t)
	}
	g.http1 = build(http1TLS, p.opts.maxConnsPerHost)
	switch {
	case !p.opts.keepAlive:
		// Every request has a connection of its own: HTTP/2 brings nothing,
		// and Go's HTTP/2 pool dials surplus connections under concurrency
		// (measured: 2,213 connections for 2,000 requests; over HTTP/1.1
		// exactly 2,000).
		g.transport = g.http1
		g.choice.Store(&choice{rt: g.http1})
	case tlsConfig == nil:
		// Plain http (through a proxy): no HTTP/2 to wait for.
		g.transport = g.http1
		g.choice.Store(&choice{rt: g.http1})
	default:
		maxConns := p.opts.maxConnsPerHost
		if maxConns == 0 {
			maxConns = 1
		}
		g.transport = build(tlsConfig, maxConns)
		if p.opts.maxConnsPerHost > 0 {
			g.streams = make(chan struct{}, p.opts.maxConnsPerHost*streamsInFlight)
		}
	}
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
		return &countedConn{Conn: conn, g: g}, nil
	}
}

type countedConn struct {
	net.Conn
	g    *generation
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.g.stats.openConns.Add(-1) })
	return c.Conn.Close()
}

func (g *generation) roundTrip(req *http.Request) (*http.Response, error) {
	if c := g.choice.Load(); c != nil {
		if c.isHTTP2 && g.streams != nil {
			return g.limitedRoundTrip(c.rt, req)
		}
		resp, err := c.rt.RoundTrip(req)
		if err == nil && c.isHTTP2 && resp.ProtoMajor == 1 {
			g.choice.Store(&choice{rt: g.http1}) // the server stopped speaking HTTP/2
		}
		return resp, err
	}
	return g.firstRoundTrip(req)
}

// limitedRoundTrip holds a stream slot from the request until its response
// body is closed: a watch keeps its stream, and so its slot, while it runs.
func (g *generation) limitedRoundTrip(rt http.RoundTripper, req *http.Request) (*http.Response, error) {
	select {
	case g.streams <- struct{}{}:
	case <-req.Context().Done():
		return nil, req.Context().Err()
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		<-g.streams
		return nil, err
	}
	resp.Body = &slotBody{ReadCloser: resp.Body, release: func() { <-g.streams }}
	return resp, nil
}

type slotBody struct {
	io.ReadCloser
	once    sync.Once
	release func()
}

func (b *slotBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.release)
	return err
}

// firstRoundTrip runs until a response shows which protocol the server
// speaks. One request goes first, on the HTTP/2 transport; the others wait
// for its response (bounded by their context), so a burst of first requests
// does not dial a connection each, then use the transport it chose.
func (g *generation) firstRoundTrip(req *http.Request) (*http.Response, error) {
	g.gateMu.Lock()
	if c := g.choice.Load(); c != nil {
		g.gateMu.Unlock()
		return g.roundTrip(req)
	}
	if wait := g.leader; wait != nil {
		g.gateMu.Unlock()
		select {
		case <-wait:
		case <-req.Context().Done():
			return nil, req.Context().Err()
		}
		if c := g.choice.Load(); c != nil {
			return g.roundTrip(req)
		}
		// The first request failed: go on without waiting, and without
		// risking HTTP/2's one-dial-at-a-time on a server that may not
		// speak it.
		return g.http1.RoundTrip(req)
	}
	done := make(chan struct{})
	g.leader = done
	g.gateMu.Unlock()

	resp, err := g.transport.RoundTrip(req)
	if err == nil {
		if resp.ProtoMajor == 2 {
			g.choice.Store(&choice{rt: g.transport, isHTTP2: true})
		} else {
			g.choice.Store(&choice{rt: g.http1})
		}
	}
	g.gateMu.Lock()
	g.leader = nil
	g.gateMu.Unlock()
	close(done)
	return resp, err
}

// close closes every connection of the generation, active ones included.
func (g *generation) close() {
	g.closed.Store(true)
	g.closeIdle()
	g.tracker.CloseAll()
}

func (g *generation) closeIdle() {
	g.transport.CloseIdleConnections()
	g.http1.CloseIdleConnections()
}
