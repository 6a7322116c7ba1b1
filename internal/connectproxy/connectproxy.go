// Package connectproxy is an HTTP proxy that serves CONNECT and nothing else,
// on 127.0.0.1, as the proxies in front of Karmada member clusters do: an
// https:// request through a proxy needs no more. It counts the tunnels it
// opens and the CONNECTs it refuses, can require a header on every CONNECT
// (proxy credentials: without an accepted value the answer is 407), and
// records each tunnel's ends and CONNECT header, so that a test can tell
// which tunnel carried a connection a server saw, and with what header.
//
// cmd/conncount puts member clusters behind it; the library's tests can use
// it wherever they need a CONNECT proxy.
package connectproxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Options configure a Proxy. The zero value accepts every CONNECT.
type Options struct {
	// RequireHeader, when set, is a header every CONNECT must carry with one
	// of RequireValues; a CONNECT without it is answered 407 Proxy
	// Authentication Required and its connection closed.
	RequireHeader string
	RequireValues []string
	// DialTimeout bounds the dial to a CONNECT's target; default 30s.
	DialTimeout time.Duration
	// AnswerDelay is how long the proxy takes to answer a CONNECT it
	// accepts, once it has dialed the target: a slow or distant proxy.
	AnswerDelay time.Duration
	// Hosts are names the proxy resolves itself (name to IP address), as a
	// site's egress proxy reaches names its clients cannot resolve: a client
	// sends a request for such a name only through the proxy.
	Hosts map[string]string
}

// requestTimeout bounds the read of a CONNECT request, so that a client that
// connects and says nothing does not hold a goroutine forever.
const requestTimeout = 30 * time.Second

// Tunnel is what the proxy saw of one tunnel.
type Tunnel struct {
	// Target is the CONNECT request's host:port; Header its header.
	Target string
	Header http.Header
	// Client and Proxy are the ends of the client's connection to the
	// proxy (remote, local); Upstream and Server those of the proxy's
	// connection to the target. Upstream is the address the target sees as
	// its peer.
	Client, Proxy, Upstream, Server string
	// Opened is when the tunnel was answered 200; Closed when it ended
	// (zero while open), and ClosedBy which end ended it: "client" (its
	// connection to the proxy closed first), "server" (the target's did)
	// or "proxy" (CloseTunnels or Close).
	Opened, Closed time.Time
	ClosedBy       string
}

// Stats are the proxy's counts since it started or since ResetStats.
type Stats struct {
	Accepted uint64 // client connections accepted
	Tunnels  uint64 // CONNECTs answered 200: tunnels opened
	Rejected uint64 // CONNECTs answered 407: the required header missing or not accepted
	Failed   uint64 // CONNECTs answered 502 (target unreachable) and requests that are not CONNECT
	Open     int    // tunnels open now
}

// Proxy is a running CONNECT proxy.
type Proxy struct {
	opts Options
	ln   net.Listener

	accepted, tunnels, rejected, failed atomic.Uint64

	mu     sync.Mutex // guards seen, open, closed and every tunnel's Closed and ClosedBy
	seen   []*tunnel  // every tunnel opened since start or ResetStats, in order
	open   map[*tunnel]struct{}
	closed bool
	wg     sync.WaitGroup // the accept loop and every connection's goroutines
}

// tunnel is an open tunnel: its record and its two connections.
type tunnel struct {
	Tunnel
	client, upstream net.Conn
}

// Start starts a proxy on a free loopback port.
func Start(o Options) (*Proxy, error) {
	if o.DialTimeout <= 0 {
		o.DialTimeout = 30 * time.Second
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{opts: o, ln: ln, open: map[*tunnel]struct{}{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL is the proxy's URL, for http.ProxyURL or a config's proxy-url.
func (p *Proxy) URL() string { return "http://" + p.Addr() }

// Stats returns the counts.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	open := len(p.open)
	p.mu.Unlock()
	return Stats{Accepted: p.accepted.Load(), Tunnels: p.tunnels.Load(), Rejected: p.rejected.Load(),
		Failed: p.failed.Load(), Open: open}
}

// ResetStats zeroes the counts and forgets the tunnels seen; open tunnels
// stay open.
func (p *Proxy) ResetStats() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.accepted.Store(0)
	p.tunnels.Store(0)
	p.rejected.Store(0)
	p.failed.Store(0)
	p.seen = nil
}

// Tunnels returns every tunnel opened since start or ResetStats, open or
// closed, in the order they opened.
func (p *Proxy) Tunnels() []Tunnel {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Tunnel, len(p.seen))
	for i, t := range p.seen {
		out[i] = t.Tunnel
	}
	return out
}

// Carried returns the open tunnel whose connection to the target has the
// ends upstream and server, as the target sees them (its peer's address and
// its own): the tunnel that carries the connection a server saw. Both ends
// are needed because an ephemeral port is unique per destination only.
func (p *Proxy) Carried(upstream, server string) (Tunnel, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for t := range p.open {
		if t.Upstream == upstream && t.Server == server {
			return t.Tunnel, true
		}
	}
	return Tunnel{}, false
}

// CloseTunnels closes every open tunnel, as a proxy restart would, and
// returns how many there were. New CONNECTs are served as before.
func (p *Proxy) CloseTunnels() int {
	p.mu.Lock()
	open := p.open
	p.open = map[*tunnel]struct{}{}
	for t := range open {
		t.end("proxy")
	}
	p.mu.Unlock()
	for t := range open {
		t.client.Close()
		t.upstream.Close()
	}
	return len(open)
}

// StopAccepting closes the proxy's listener: new connections are refused,
// tunnels open go on until Close.
func (p *Proxy) StopAccepting() error { return p.ln.Close() }

// Close stops the proxy, closes its tunnels and returns once every goroutine
// it started has exited. It may be called more than once.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.CloseTunnels()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.handle(c)
		}()
	}
}

// handle reads one CONNECT from c, opens the tunnel and pipes it until
// either side ends.
func (p *Proxy) handle(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(requestTimeout))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		c.Close()
		return
	}
	if req.Method != http.MethodConnect {
		p.failed.Add(1)
		fmt.Fprintf(c, "HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		c.Close()
		return
	}
	if h := p.opts.RequireHeader; h != "" && !slices.Contains(p.opts.RequireValues, req.Header.Get(h)) {
		p.rejected.Add(1)
		fmt.Fprintf(c, "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"connectproxy\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		c.Close()
		return
	}
	target := req.Host
	if host, port, err := net.SplitHostPort(target); err == nil && p.opts.Hosts[host] != "" {
		target = net.JoinHostPort(p.opts.Hosts[host], port)
	}
	up, err := net.DialTimeout("tcp", target, p.opts.DialTimeout)
	if err != nil {
		p.failed.Add(1)
		fmt.Fprintf(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		c.Close()
		return
	}
	t := &tunnel{Tunnel: Tunnel{
		Target: req.Host, Header: req.Header,
		Client: c.RemoteAddr().String(), Proxy: c.LocalAddr().String(),
		Upstream: up.LocalAddr().String(), Server: up.RemoteAddr().String(),
	}, client: c, upstream: up}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	t.Opened = time.Now()
	p.open[t] = struct{}{}
	p.seen = append(p.seen, t)
	p.tunnels.Add(1)
	p.mu.Unlock()
	ended := func(by string) {
		p.mu.Lock()
		t.end(by)
		delete(p.open, t)
		p.mu.Unlock()
	}

	_ = c.SetReadDeadline(time.Time{})
	time.Sleep(p.opts.AnswerDelay)
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		ended("client")
		c.Close()
		up.Close()
		return
	}
	// What the client sent after its CONNECT, already read into br, goes
	// first (a client may start its TLS handshake without waiting).
	var client io.Reader = c
	if n := br.Buffered(); n > 0 {
		client = io.MultiReader(io.LimitReader(br, int64(n)), c)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		copyThrough(up, client)
		ended("client")
		up.Close()
		c.Close()
	}()
	copyThrough(c, up)
	ended("server")
	c.Close()
	up.Close()
	<-done
}

// end records that t ended, by whom, unless it already had; p.mu is held.
func (t *tunnel) end(by string) {
	if t.ClosedBy == "" {
		t.Closed, t.ClosedBy = time.Now(), by
	}
}

// copyThrough copies src to dst through a buffer of its own. io.Copy between
// two TCP connections splices through kernel pipes that the runtime keeps
// cached after the tunnel closed; a test counting the process's file
// descriptors would count them as the proxy's.
func copyThrough(dst io.Writer, src io.Reader) {
	buf := make([]byte, 32<<10)
	_, _ = io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
}
