// Package testserver is a TLS API server that behaves like kube-apiserver
// where connections are concerned: HTTP/2 with a bounded number of concurrent
// streams, client-certificate (and optionally bearer-token) authentication,
// discovery, list and watch of a few core resources, and GOAWAY on a share of
// requests. It counts, on the server side, the connections it accepts, how
// many are open, and how many TLS handshakes were full or resumed, and it
// records who it saw on each request.
//
// It is used by the library's tests, by cmd/conncount and by fault tests. It
// is not a Kubernetes API server: objects are static, writes are refused.
package testserver

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ClientAuth selects how the server asks for client certificates.
type ClientAuth int

const (
	// RequireClientCert (the default) requires and verifies a client
	// certificate on every connection.
	RequireClientCert ClientAuth = iota
	// VerifyClientCertIfGiven verifies a client certificate when one is sent
	// and otherwise lets the request authenticate by bearer token.
	VerifyClientCertIfGiven
)

// Attributes describe a resource request for Options.Authorize.
type Attributes struct {
	User      string
	Groups    []string
	Verb      string // get, list, watch, create
	APIGroup  string
	Resource  string
	Namespace string
	Name      string
}

// Options configure Start. The zero value is a usable server.
type Options struct {
	// Addr to listen on; default "127.0.0.1:0" (a free port).
	Addr string
	// CA signs the serving certificate and, unless ClientCAs is set, is the
	// only CA trusted for client certificates. A new CA is made when nil.
	CA *CA
	// ServerCert overrides the serving certificate issued from CA.
	ServerCert *KeyPair
	// ClientCAs overrides the pool of CAs trusted for client certificates.
	ClientCAs *x509.CertPool
	// ClientAuth: RequireClientCert (default) or VerifyClientCertIfGiven.
	ClientAuth ClientAuth
	// MinTLSVersion and MaxTLSVersion (tls.VersionTLS12, tls.VersionTLS13);
	// zero means Go's defaults.
	MinTLSVersion, MaxTLSVersion uint16
	// MaxConcurrentStreams per HTTP/2 connection; default 100, like
	// kube-apiserver.
	MaxConcurrentStreams int
	// DisableHTTP2 serves HTTP/1.1 only.
	DisableHTTP2 bool
	// SessionTicketsDisabled turns TLS session resumption off (it is on by
	// default, as in Go and kube-apiserver).
	SessionTicketsDisabled bool
	// Tokens maps bearer tokens to user names.
	Tokens map[string]string
	// Authorize decides resource requests; nil allows everything. A denied
	// request gets 403 with kube-apiserver's message.
	Authorize func(Attributes) bool
	// GoawayChance in [0, 1]: the share of non-watch HTTP/2 requests answered
	// with "Connection: close", which makes Go's HTTP/2 server send GOAWAY
	// (what kube-apiserver's --goaway-chance does).
	GoawayChance float64
	// Latency is added before every request is served.
	Latency time.Duration
	// BookmarkInterval between watch bookmarks sent to clients that allow
	// them; default 5s; negative disables bookmarks.
	BookmarkInterval time.Duration
	// LogInterval between the lines a followed pod log
	// (/api/v1/namespaces/NS/pods/NAME/log?follow=true) writes; default 100ms.
	LogInterval time.Duration
	// Nodes is the number of nodes served; default 3.
	Nodes int
	// OnRequest, when set, is called for every request after authentication
	// and before it is served. It must be safe for concurrent use.
	OnRequest func(RequestInfo)
	// RecentRequests bounds the log returned by Requests; default 1024.
	RecentRequests int
	// ErrorLog receives the HTTP server's errors (TLS handshake failures and
	// the like); default: discarded.
	ErrorLog *log.Logger
	// RecordHeaders puts a copy of every request's headers in
	// RequestInfo.Header.
	RecordHeaders bool
	// Handler, when set, serves every request in place of the API: another
	// protocol (a fake OpenStack) behind the same TLS, counted connections
	// and restarts. The API's authentication, counters and faults do not
	// apply to it.
	Handler http.Handler
}

// RequestInfo is what the server saw on one request.
type RequestInfo struct {
	Time       time.Time
	Method     string
	Path       string
	Query      string
	Proto      string // "HTTP/2.0" or "HTTP/1.1"
	RemoteAddr string
	// CertCN is the common name of the verified client certificate, "" if
	// none; CertGroups its organizations.
	CertCN     string
	CertGroups []string
	// Token is the bearer token of the Authorization header, "" if none.
	Token string
	// User is the authenticated user ("" when authentication failed).
	User      string
	UserAgent string
	// AcceptEncoding is the request's Accept-Encoding header ("gzip" when
	// Go's transport asked for compression).
	AcceptEncoding string
	// Resumed reports whether the request's TLS connection was resumed.
	Resumed    bool
	TLSVersion uint16
	// Watch is true for ?watch=true requests.
	Watch bool
	// Header is a copy of the request's headers, with Options.RecordHeaders.
	Header http.Header
}

// Stats are counters kept by the server. Connection counts come from the
// server's ConnState hook, handshake counts from its TLS VerifyConnection
// hook.
type Stats struct {
	// Accepted TCP connections.
	Accepted uint64
	// Open connections now, and the most open at once since the last reset.
	Open, PeakOpen int
	// Successful TLS handshakes: full ones and resumed ones.
	FullHandshakes, ResumedHandshakes uint64
	// Requests served (all paths), watches among them, and GOAWAYs sent.
	Requests, Watches, Goaways uint64
	// Upgrades answered 101 (websocket, SPDY), each then echoing what the
	// client writes on a connection of its own.
	Upgrades uint64
	// Unauthorized (401) and Forbidden (403) answers.
	Unauthorized, Forbidden uint64
}

// Server is a running test server.
type Server struct {
	opts     Options
	ca       *CA
	tlsCfg   *tls.Config
	handler  http.Handler
	api      *api
	addr     string
	goaway   atomic.Uint64 // math.Float64bits of the chance
	latency  atomic.Int64
	delayed  atomic.Int64 // requests held by latency now
	watchers sync.WaitGroup

	accepted, full, resumed    atomic.Uint64
	requests, watches, goaways atomic.Uint64
	upgrades                   atomic.Uint64
	unauthorized, forbidden    atomic.Uint64
	open                       atomic.Int64

	mu       sync.Mutex
	peak     int
	conns    map[net.Conn]struct{}
	hijacked map[net.Conn]struct{} // upgraded connections, closed by Stop
	srv      *http.Server
	serveErr chan error
	done     chan struct{} // closed when the current incarnation stops
	closed   bool
	recent   []RequestInfo
	next     int
}

// Start starts a server.
func Start(opts Options) (*Server, error) {
	if opts.Addr == "" {
		opts.Addr = "127.0.0.1:0"
	}
	if opts.MaxConcurrentStreams == 0 {
		opts.MaxConcurrentStreams = 100
	}
	if opts.BookmarkInterval == 0 {
		opts.BookmarkInterval = 5 * time.Second
	}
	if opts.LogInterval == 0 {
		opts.LogInterval = 100 * time.Millisecond
	}
	if opts.Nodes == 0 {
		opts.Nodes = 3
	}
	if opts.RecentRequests == 0 {
		opts.RecentRequests = 1024
	}
	if opts.ErrorLog == nil {
		opts.ErrorLog = log.New(io.Discard, "", 0)
	}
	ca := opts.CA
	if ca == nil {
		var err error
		if ca, err = NewCA("testserver-ca"); err != nil {
			return nil, err
		}
	}
	serving := opts.ServerCert
	if serving == nil {
		var err error
		if serving, err = ca.IssueServer(); err != nil {
			return nil, err
		}
	}
	tc, err := serving.TLSCertificate()
	if err != nil {
		return nil, err
	}
	clientCAs := opts.ClientCAs
	if clientCAs == nil {
		clientCAs = ca.Pool()
	}
	s := &Server{
		opts:     opts,
		ca:       ca,
		conns:    map[net.Conn]struct{}{},
		hijacked: map[net.Conn]struct{}{},
	}
	s.SetGoawayChance(opts.GoawayChance)
	s.SetLatency(opts.Latency)
	s.tlsCfg = &tls.Config{
		Certificates:           []tls.Certificate{tc},
		ClientCAs:              clientCAs,
		ClientAuth:             tls.RequireAndVerifyClientCert,
		MinVersion:             opts.MinTLSVersion,
		MaxVersion:             opts.MaxTLSVersion,
		SessionTicketsDisabled: opts.SessionTicketsDisabled,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if cs.DidResume {
				s.resumed.Add(1)
			} else {
				s.full.Add(1)
			}
			return nil
		},
	}
	if opts.ClientAuth == VerifyClientCertIfGiven {
		s.tlsCfg.ClientAuth = tls.VerifyClientCertIfGiven
	}
	s.api = newAPI(s)
	s.handler = http.HandlerFunc(s.serveHTTP)
	if opts.Handler != nil {
		s.handler = opts.Handler
	}
	if err := s.listen(opts.Addr); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Server) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("testserver: listen %s: %w", addr, err)
	}
	srv := &http.Server{
		Handler:           s.handler,
		TLSConfig:         s.tlsCfg,
		ConnState:         s.connState,
		ErrorLog:          s.opts.ErrorLog,
		ReadHeaderTimeout: 30 * time.Second,
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: s.opts.MaxConcurrentStreams},
	}
	if s.opts.DisableHTTP2 {
		srv.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){}
	}
	done := make(chan struct{})
	errc := make(chan error, 1)
	s.mu.Lock()
	s.srv = srv
	s.addr = ln.Addr().String()
	s.done = done
	s.serveErr = errc
	s.mu.Unlock()
	go func() { errc <- srv.ServeTLS(ln, "", "") }()
	return nil
}

func (s *Server) connState(c net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		s.accepted.Add(1)
		n := int(s.open.Add(1))
		s.mu.Lock()
		s.conns[c] = struct{}{}
		if n > s.peak {
			s.peak = n
		}
		s.mu.Unlock()
	case http.StateClosed, http.StateHijacked:
		s.mu.Lock()
		if _, ok := s.conns[c]; ok {
			delete(s.conns, c)
			s.open.Add(-1)
		}
		s.mu.Unlock()
	}
}

// URL is the server's base URL, e.g. https://127.0.0.1:40123.
func (s *Server) URL() string { return "https://" + s.Addr() }

// Addr is the host:port the server listens on.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// CA is the CA that signed the serving certificate (and, by default, is
// trusted for client certificates).
func (s *Server) CA() *CA { return s.ca }

// OpenConns is the number of connections open now; cheap enough to sample
// often.
func (s *Server) OpenConns() int { return int(s.open.Load()) }

// Stats returns a snapshot of the counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	peak := s.peak
	s.mu.Unlock()
	return Stats{
		Accepted:          s.accepted.Load(),
		Open:              int(s.open.Load()),
		PeakOpen:          peak,
		FullHandshakes:    s.full.Load(),
		ResumedHandshakes: s.resumed.Load(),
		Requests:          s.requests.Load(),
		Watches:           s.watches.Load(),
		Goaways:           s.goaways.Load(),
		Upgrades:          s.upgrades.Load(),
		Unauthorized:      s.unauthorized.Load(),
		Forbidden:         s.forbidden.Load(),
	}
}

// ResetStats zeroes the counters; the peak restarts from the connections open
// now, and the recent-request log is emptied.
func (s *Server) ResetStats() {
	for _, c := range []*atomic.Uint64{&s.accepted, &s.full, &s.resumed, &s.requests, &s.watches, &s.goaways, &s.upgrades, &s.unauthorized, &s.forbidden} {
		c.Store(0)
	}
	s.mu.Lock()
	s.peak = int(s.open.Load())
	s.recent = nil
	s.next = 0
	s.mu.Unlock()
}

// SetGoawayChance changes Options.GoawayChance at run time.
func (s *Server) SetGoawayChance(p float64) {
	s.goaway.Store(math.Float64bits(p))
}

// SetLatency changes Options.Latency at run time.
func (s *Server) SetLatency(d time.Duration) { s.latency.Store(int64(d)) }

// Delayed returns how many requests SetLatency's delay holds now: requests
// the server has read and not yet answered.
func (s *Server) Delayed() int { return int(s.delayed.Load()) }

// Requests returns the recent-request log, oldest first.
func (s *Server) Requests() []RequestInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.recent) < s.opts.RecentRequests {
		return append([]RequestInfo(nil), s.recent...)
	}
	out := make([]RequestInfo, 0, len(s.recent))
	out = append(out, s.recent[s.next:]...)
	return append(out, s.recent[:s.next]...)
}

// LastRequest returns the most recent request whose path is path (any path
// when path is ""), and whether there was one.
func (s *Server) LastRequest(path string) (RequestInfo, bool) {
	reqs := s.Requests()
	for i := len(reqs) - 1; i >= 0; i-- {
		if path == "" || reqs[i].Path == path {
			return reqs[i], true
		}
	}
	return RequestInfo{}, false
}

func (s *Server) record(ri RequestInfo) {
	s.mu.Lock()
	if len(s.recent) < s.opts.RecentRequests {
		s.recent = append(s.recent, ri)
	} else {
		s.recent[s.next] = ri
		s.next = (s.next + 1) % len(s.recent)
	}
	s.mu.Unlock()
	if s.opts.OnRequest != nil {
		s.opts.OnRequest(ri)
	}
}

// CloseClientConnections closes every open connection abruptly (no GOAWAY),
// as a crashed server or a broken network would. The server keeps serving.
func (s *Server) CloseClientConnections() {
	s.mu.Lock()
	conns := make([]net.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// Stop stops serving: the listener and every connection are closed, watches
// end. Restart serves again on the same address.
func (s *Server) Stop() error {
	s.mu.Lock()
	srv, done, errc := s.srv, s.done, s.serveErr
	s.srv = nil
	if srv != nil {
		close(done)
	}
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	err := srv.Close()
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	s.CloseClientConnections()
	s.mu.Lock()
	for c := range s.hijacked {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.watchers.Wait()
	// Connections closed under the server are reported StateClosed by
	// their serving goroutines; wait briefly so OpenConns settles.
	deadline := time.Now().Add(5 * time.Second)
	for s.open.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	return err
}

// Restart stops the server if it runs and serves again on the same address
// with the same certificates. Counters are kept. TLS session tickets issued
// before the restart may or may not resume afterwards.
func (s *Server) Restart() error {
	if err := s.Stop(); err != nil {
		return err
	}
	s.mu.Lock()
	closed := s.closed
	addr := s.addr
	s.mu.Unlock()
	if closed {
		return errors.New("testserver: Restart after Close")
	}
	var err error
	for i := 0; i < 50; i++ { // the port may linger briefly
		if err = s.listen(addr); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return err
}

// Close stops the server for good and waits for its goroutines to end.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return s.Stop()
}

// addWatcher registers a watch unless the incarnation done belongs to has
// stopped; Stop waits for registered watches.
func (s *Server) addWatcher(done <-chan struct{}) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-done:
		return false
	default:
	}
	s.watchers.Add(1)
	return true
}

func (s *Server) currentDone() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done
}

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	done := s.currentDone()
	if d := time.Duration(s.latency.Load()); d > 0 {
		s.delayed.Add(1)
		t := time.NewTimer(d)
		select {
		case <-t.C:
			s.delayed.Add(-1)
		case <-r.Context().Done():
			t.Stop()
			s.delayed.Add(-1)
			return
		case <-done:
			// The server is stopping: the request dies with it, as on a
			// real server that goes away. Returning would answer 200.
			t.Stop()
			s.delayed.Add(-1)
			panic(http.ErrAbortHandler)
		}
	}
	ri := RequestInfo{
		Time:           time.Now(),
		Method:         r.Method,
		Path:           r.URL.Path,
		Query:          r.URL.RawQuery,
		Proto:          r.Proto,
		RemoteAddr:     r.RemoteAddr,
		UserAgent:      r.UserAgent(),
		AcceptEncoding: r.Header.Get("Accept-Encoding"),
		Watch:          r.URL.Query().Get("watch") == "true" || r.URL.Query().Get("watch") == "1",
	}
	if s.opts.RecordHeaders {
		ri.Header = r.Header.Clone()
	}
	if r.TLS != nil {
		ri.Resumed = r.TLS.DidResume
		ri.TLSVersion = r.TLS.Version
		if len(r.TLS.PeerCertificates) > 0 {
			ri.CertCN = r.TLS.PeerCertificates[0].Subject.CommonName
			ri.CertGroups = r.TLS.PeerCertificates[0].Subject.Organization
		}
	}
	if h := r.Header.Get("Authorization"); len(h) > 7 && strings.EqualFold(h[:7], "bearer ") {
		ri.Token = strings.TrimSpace(h[7:])
	}
	var groups []string
	switch {
	case ri.CertCN != "":
		ri.User, groups = ri.CertCN, ri.CertGroups
	case ri.Token != "":
		if u, ok := s.opts.Tokens[ri.Token]; ok {
			ri.User = u
		}
	}
	s.record(ri)
	if ri.User == "" {
		s.unauthorized.Add(1)
		writeStatus(w, http.StatusUnauthorized, "Unauthorized", "Unauthorized", nil)
		return
	}
	if isUpgrade(r) {
		s.upgrade(w, r, done)
		return
	}
	if ri.Watch {
		s.watches.Add(1)
	} else if r.ProtoMajor == 2 {
		if p := math.Float64frombits(s.goaway.Load()); p > 0 && rand.Float64() < p {
			s.goaways.Add(1)
			w.Header().Set("Connection", "close")
		}
	}
	s.api.serve(w, r, ri.User, groups, done)
}

// watchContext ends when the request ends or the server stops.
func watchContext(r *http.Request, done <-chan struct{}) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(r.Context())
	go func() {
		select {
		case <-done:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// isUpgrade reports whether r asks to switch protocols (websocket, SPDY).
func isUpgrade(r *http.Request) bool {
	if r.Header.Get("Upgrade") == "" {
		return false
	}
	for _, v := range r.Header.Values("Connection") {
		for _, tok := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(tok), "upgrade") {
				return true
			}
		}
	}
	return false
}

// upgrade answers an upgrade request with 101 and the protocol asked for,
// then echoes every byte the client writes until it closes its side, as an
// exec session echoing stdin would. The connection is the client's own: it
// is never reused for requests.
func (s *Server) upgrade(w http.ResponseWriter, r *http.Request, done <-chan struct{}) {
	hj, ok := w.(http.Hijacker)
	if !ok { // HTTP/2 cannot switch protocols
		writeStatus(w, http.StatusBadRequest, "BadRequest", "upgrade requests need HTTP/1.1", nil)
		return
	}
	if !s.addWatcher(done) {
		return
	}
	defer s.watchers.Done()
	conn, brw, err := hj.Hijack()
	if err != nil {
		return
	}
	s.mu.Lock()
	s.hijacked[conn] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.hijacked, conn)
		s.mu.Unlock()
		conn.Close()
	}()
	s.upgrades.Add(1)
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", r.Header.Get("Upgrade"))
	if brw.Flush() != nil {
		return
	}
	buf := make([]byte, 4096)
	for {
		n, err := brw.Read(buf)
		if n > 0 {
			if _, werr := conn.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
