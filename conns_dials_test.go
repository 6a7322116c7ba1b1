package sharedtransport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// Tests that no request waits on a dial not its own: each runs the same
// requests through client-go alone and through the pool, up to three
// times (servedAsClientGo), against a dial that never finishes, a slow
// one, or a protocol that changes under the client.

// servedAsClientGo runs attempt, through client-go alone and through the
// pool, up to 3 times: the pool must serve what client-go alone serves in
// one of them. A scheduler that stalls the test can make either miss a
// deadline; a pool that waits where net/http dials misses it every time.
func servedAsClientGo(t *testing.T, what string, attempt func(t *testing.T, pooled bool) error) {
	var errs []error
	for range 3 {
		var controlErr, poolErr error
		t.Run("client-go alone", func(t *testing.T) { controlErr = attempt(t, false) })
		t.Run("pool", func(t *testing.T) { poolErr = attempt(t, true) })
		if controlErr == nil && poolErr == nil {
			return
		}
		errs = append(errs, fmt.Errorf("client-go alone: %v; pool: %v", controlErr, poolErr))
	}
	t.Errorf("%s, 3 attempts: %v", what, errs)
}

// getsDue sends n lists at once to base through client, due in due, logs
// what came back and how many connections accepted counts, and returns the
// protocols they came over and the first error.
func getsDue(t *testing.T, pooled bool, client *http.Client, base string, n int, due time.Duration, what string, accepted func() int64) (map[string]int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), due)
	defer cancel()
	protos, err := concurrentGets(ctx, client, base, what, n)
	t.Logf("pool %v: %d lists due in %v, %s: %v %v; %d connections accepted", pooled, n, due, what, protos, err, accepted())
	return protos, err
}

// faultyRelay forwards the connections it accepts to its target of the
// moment, but one: the connection it is told to wedge is held unanswered,
// as a wedged backend behind a load balancer holds it, and reset after
// resetAfter (at the test's end when zero).
type faultyRelay struct {
	ln         net.Listener
	target     atomic.Value // string: where a connection accepted now goes
	accepted   atomic.Int64
	wedge      atomic.Int64 // the number, from 1 in accept order, of the connection to wedge; 0: none
	resetAfter time.Duration
	done       chan struct{} // closed when the test ends
	wg         sync.WaitGroup

	mu    sync.Mutex // guards conns
	conns []net.Conn
}

func newFaultyRelay(t testing.TB, target string, resetAfter time.Duration) *faultyRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	r := &faultyRelay{ln: ln, resetAfter: resetAfter, done: make(chan struct{})}
	r.target.Store(target)
	r.wg.Add(1)
	go r.serve()
	t.Cleanup(func() {
		close(r.done)
		ln.Close()
		r.mu.Lock()
		for _, c := range r.conns {
			c.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
	return r
}

func (r *faultyRelay) url() string { return "https://" + r.ln.Addr().String() }

// wedgeNext wedges the next connection the relay accepts.
func (r *faultyRelay) wedgeNext() { r.wedge.Store(r.accepted.Load() + 1) }

func (r *faultyRelay) serve() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		n := r.accepted.Add(1)
		r.keep(c)
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer c.Close()
			if n == r.wedge.Load() {
				r.hold(c)
				return
			}
			up, err := net.Dial("tcp", r.target.Load().(string))
			if err != nil {
				return
			}
			r.keep(up)
			defer up.Close()
			go func() {
				io.Copy(up, c)
				up.Close()
			}()
			io.Copy(c, up)
		}()
	}
}

// keep records c, to be closed when the test ends.
func (r *faultyRelay) keep(c net.Conn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.conns = append(r.conns, c)
}

// hold keeps c unanswered, then resets it.
func (r *faultyRelay) hold(c net.Conn) {
	var timeout <-chan time.Time
	if r.resetAfter > 0 {
		timeout = time.After(r.resetAfter)
	}
	select {
	case <-timeout:
	case <-r.done:
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0) // a reset, not a close
	}
}

// relayedClient returns an HTTP client of f's alice through r, by
// client-go alone or through a new pool.
func relayedClient(t testing.TB, f *fixture, r *faultyRelay, pooled bool) *http.Client {
	t.Helper()
	cfg := f.srv.RestConfig(f.alice)
	cfg.Host = r.url()
	if !pooled {
		return clientGoClient(t, cfg)
	}
	return httpClient(t, newPool(t), cfg)
}

// TestWedgedFirstConnection: the first connection the server's front
// accepts never finishes its TLS handshake. A burst of 6 lists due in 1 s,
// at a cold start and after a GOAWAY, is served through the pool as through
// client-go alone: each request dials, and takes whichever connection is
// ready first.
func TestWedgedFirstConnection(t *testing.T) {
	const n, due = 6, time.Second
	for _, when := range []string{"cold start", "after a GOAWAY"} {
		t.Run(when, func(t *testing.T) {
			servedAsClientGo(t, "a burst beside a wedged connection, "+when, func(t *testing.T, pooled bool) error {
				f := newFixture(t, testserver.Options{})
				r := newFaultyRelay(t, f.srv.Addr(), 0)
				client := relayedClient(t, f, r, pooled)
				if when == "cold start" {
					r.wedgeNext()
				} else {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					if _, err := getUA(ctx, client, r.url(), "first"); err != nil {
						t.Fatal(err)
					}
					f.srv.SetGoawayChance(1)
					if _, err := getUA(ctx, client, r.url(), "goaway"); err != nil {
						t.Fatal(err)
					}
					f.srv.SetGoawayChance(0)
					r.wedgeNext()
				}
				_, err := getsDue(t, pooled, client, r.url(), n, due, "beside a wedged connection", r.accepted.Load)
				return err
			})
		})
	}
}

// TestWedgedConnectionBesideFullOne: the one connection there is carries
// 100 requests the server holds, all it allows; the next connection
// accepted hangs. 5 more lists due in 2 s are served through the pool as
// through client-go alone: each dials, and the 4 connections that answer
// carry all 5.
func TestWedgedConnectionBesideFullOne(t *testing.T) {
	const n, due = 5, 2 * time.Second
	servedAsClientGo(t, "lists beside a full connection and a wedged one", func(t *testing.T, pooled bool) error {
		hold := newRequestHold(t)
		f := newFixture(t, testserver.Options{OnRequest: hold.onRequest})
		r := newFaultyRelay(t, f.srv.Addr(), 0)
		client := relayedClient(t, f, r, pooled)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := getUA(ctx, client, r.url(), "first"); err != nil {
			t.Fatal(err)
		}
		release := sendHeld(ctx, t, hold, client, r.url(), 100)
		defer release()
		waitFor(t, "the server holds 100 requests", func() bool { return hold.held.Load() == 100 })
		r.wedgeNext()
		_, err := getsDue(t, pooled, client, r.url(), n, due, "beside 100 held and a wedged connection", r.accepted.Load)
		return err
	})
}

// TestResetFirstConnectionBesideWatches: 30 watches start at once; the
// first connection accepted is held for 300 ms and reset. Every watch
// starts, over HTTP/2, through the pool as through client-go alone: the
// request whose dial failed had taken another's connection by then. (A
// clientset would hide a lost watch by sending it again: these are sent
// once.)
func TestResetFirstConnectionBesideWatches(t *testing.T) {
	const watches = 30
	servedAsClientGo(t, "watches beside a reset first connection", func(t *testing.T, pooled bool) error {
		f := newFixture(t, testserver.Options{})
		r := newFaultyRelay(t, f.srv.Addr(), 300*time.Millisecond)
		r.wedgeNext()
		client := relayedClient(t, f, r, pooled)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		errs := make(chan error, watches)
		for range watches {
			go func() { errs <- startWatch(ctx, client, r.url()) }()
		}
		var first error
		failed := 0
		for range watches {
			if err := <-errs; err != nil {
				failed++
				first = err
			}
		}
		t.Logf("pool %v: %d watches, %d failed (%v); the relay accepted %d connections", pooled, watches, failed, first, r.accepted.Load())
		if first != nil {
			return fmt.Errorf("%d of %d watches failed: %w", failed, watches, first)
		}
		return nil
	})
}

// startWatch starts a watch of nodes at base through client, and returns
// once its response came over HTTP/2 (the body is left to ctx), or fails.
func startWatch(ctx context.Context, client *http.Client, base string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/v1/nodes?watch=true", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != 2 {
		return fmt.Errorf("watch: %s over %s", resp.Status, resp.Proto)
	}
	return nil
}

// TestProtocolChangeWhileDraining: the connection a client has is an
// HTTP/2 one that got GOAWAY and drains a request the server holds; new
// connections reach a backend that speaks HTTP/1.1 alone and takes 100 ms
// over each list. 16 lists due in 800 ms are served through the pool as
// through client-go alone: each on a connection of its own, none queued
// behind another.
func TestProtocolChangeWhileDraining(t *testing.T) {
	const n, due = 16, 800 * time.Millisecond
	servedAsClientGo(t, "lists after the protocol changed", func(t *testing.T, pooled bool) error {
		hold := newRequestHold(t)
		f := newFixture(t, testserver.Options{OnRequest: hold.onRequest})
		serving, err := f.ca.IssueServer()
		must(t, err)
		h2 := f.startServer(t, testserver.Options{ServerCert: serving, OnRequest: hold.onRequest})
		h1 := f.startServer(t, testserver.Options{ServerCert: serving, DisableHTTP2: true, Latency: 100 * time.Millisecond})
		r := newFaultyRelay(t, h2.Addr(), 0)
		client := relayedClient(t, f, r, pooled)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if proto, err := getUA(ctx, client, r.url(), "first"); err != nil || proto != "HTTP/2.0" {
			t.Fatalf("the first list: %s %v", proto, err)
		}
		release := sendHeld(ctx, t, hold, client, r.url(), 1)
		defer release()
		waitFor(t, "the server holds a request", func() bool { return hold.held.Load() == 1 })
		h2.SetGoawayChance(1)
		if _, err := getUA(ctx, client, r.url(), "goaway"); err != nil {
			t.Fatal(err)
		}
		r.target.Store(h1.Addr())
		protos, err := getsDue(t, pooled, client, r.url(), n, due, "after the change to HTTP/1.1", func() int64 { return int64(h1.Stats().Accepted) })
		if err == nil && protos["HTTP/1.1"] != n {
			return fmt.Errorf("%d lists: %v, want all over HTTP/1.1", n, protos)
		}
		return err
	})
}

// slowDialClient returns an HTTP client of cfg, through client-go alone or
// through the pool, whose every dial takes d.
func slowDialClient(t testing.TB, cfg *rest.Config, pooled bool, d time.Duration) *http.Client {
	t.Helper()
	cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		var nd net.Dialer
		return nd.DialContext(ctx, network, addr)
	}
	if !pooled {
		return clientGoClient(t, cfg)
	}
	return httpClient(t, newPool(t, WithDialIdentity(func(*rest.Config) string { return "slow dials" })), cfg)
}

// TestDueSoonBesideFullConnection: one request due in 420 ms beside 100
// the server holds on a connection allowing 100 streams, every dial taking
// 350 ms: net/http dials for it at once, and it is served through the pool
// as through client-go alone.
func TestDueSoonBesideFullConnection(t *testing.T) {
	const dial, due = 350 * time.Millisecond, 420 * time.Millisecond
	servedAsClientGo(t, "a request due soon beside a full connection", func(t *testing.T, pooled bool) error {
		hold := newRequestHold(t)
		f := newFixture(t, testserver.Options{OnRequest: hold.onRequest})
		client := slowDialClient(t, f.srv.RestConfig(f.alice), pooled, dial)
		// The first request alone, so that client-go alone has one
		// connection to fill too.
		if _, err := getUA(context.Background(), client, f.srv.URL(), "first"); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		const n = 100
		release := sendHeld(ctx, t, hold, client, f.srv.URL(), n)
		defer func() {
			release()
			cancel()
		}()
		waitFor(t, "the server holds 100 requests", func() bool { return hold.held.Load() == n })
		dueCtx, cancelDue := context.WithTimeout(context.Background(), due)
		defer cancelDue()
		_, err := getUA(dueCtx, client, f.srv.URL(), "due soon")
		t.Logf("pool %v: one more request, due in %v, dials taking %v: %v; the server accepted %d connections", pooled, due, dial, err, f.srv.Stats().Accepted)
		return err
	})
}

// TestHTTP1Burst: against a server that speaks HTTP/1.1 only, a burst of
// 8 lists due in 480 ms, every dial taking 300 ms and every list 100 ms, at
// a cold start and once the first connections are gone: each dials at
// once, and all 8 are served through the pool as through client-go alone
// (one after another on one connection, or behind a first one's dial, they
// are not).
func TestHTTP1Burst(t *testing.T) {
	const dial, due, n = 300 * time.Millisecond, 480 * time.Millisecond, 8
	for _, when := range []string{"cold start", "after a quiet spell"} {
		t.Run(when, func(t *testing.T) {
			servedAsClientGo(t, "a burst to an HTTP/1.1 server, "+when, func(t *testing.T, pooled bool) error {
				f := newFixture(t, testserver.Options{DisableHTTP2: true, Latency: 100 * time.Millisecond})
				client := slowDialClient(t, f.srv.RestConfig(f.alice), pooled, dial)
				if when != "cold start" {
					if proto, err := getUA(context.Background(), client, f.srv.URL(), "first"); err != nil || proto != "HTTP/1.1" {
						t.Fatalf("the first list: %s %v", proto, err)
					}
					f.srv.CloseClientConnections()
					waitFor(t, "the server's connections closed", func() bool { return f.srv.OpenConns() == 0 })
				}
				_, err := getsDue(t, pooled, client, f.srv.URL(), n, due, fmt.Sprint("dials taking ", dial), func() int64 { return int64(f.srv.Stats().Accepted) })
				return err
			})
		})
	}
}

// TestSlowTunnelsOneStream: TLSTransport through a CONNECT proxy that
// answers in 300 ms, to a front allowing one stream per connection; 6 lists
// due in 600 ms, as many tunnels dialed at once. Karmada's own transport, a
// new one per request, serves them all, and so does the pool with
// keep-alive off. A transport shared by every request, keep-alive on, may
// not: Go's HTTP/2 takes a new tunnel's connection as able to carry more
// than one request until the server's settings arrive, closes the other new
// tunnels as surplus and dials again. That is sharing's cost, client-go's
// shared transport's as the pool's (logged); what the pool must not add is
// a wait: each request dials a tunnel of its own at once, as with
// client-go's shared transport.
func TestSlowTunnelsOneStream(t *testing.T) {
	const n, due = 6, 600 * time.Millisecond
	srv, err := testserver.Start(testserver.Options{MaxConcurrentStreams: 1, ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens: map[string]string{"token-x": "x"}})
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	proxy := startConnectProxy(t, connectproxy.Options{AnswerDelay: 300 * time.Millisecond})
	proxyURL, err := url.Parse(proxy.url())
	must(t, err)
	settings := func() TLSTransportConfig {
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(srv.CA().CertPEM())
		return TLSTransportConfig{TLS: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS13}, Proxy: proxyURL}
	}
	// karmada builds the transport Karmada's proxy builds per request;
	// shared, one such transport with keep-alive on for every request.
	karmada := func(keepAlive bool) *http.Transport {
		c := settings()
		return utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: c.TLS, Proxy: http.ProxyURL(c.Proxy), DisableKeepAlives: !keepAlive})
	}
	// served sends the lists at once, each through what rt gives it, and
	// returns how many were answered in time.
	served := func(rt func() (http.RoundTripper, error)) (int, error) {
		ctx, cancel := context.WithTimeout(context.Background(), due)
		defer cancel()
		var ok atomic.Int64
		var first atomic.Pointer[error]
		var wg sync.WaitGroup
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := func() error {
					rt, err := rt()
					if err != nil {
						return err
					}
					req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL()+"/api/v1/nodes", nil)
					if err != nil {
						return err
					}
					req.Header.Set("Authorization", "Bearer token-x")
					resp, err := rt.RoundTrip(req)
					if err != nil {
						return err
					}
					defer resp.Body.Close()
					if _, err := io.Copy(io.Discard, resp.Body); err != nil {
						return err
					}
					return nil
				}()
				if err != nil {
					first.CompareAndSwap(nil, &err)
					return
				}
				ok.Add(1)
			}()
		}
		wg.Wait()
		if err := first.Load(); err != nil {
			return int(ok.Load()), *err
		}
		return int(ok.Load()), nil
	}
	// Up to 3 attempts, until one shows keep-alive off serving all, as
	// Karmada's own transport: timing decides how many each serves.
	var results []string
	allServed := false
	for attempt := 1; attempt <= 3 && !allServed; attempt++ {
		got := map[string]int{}
		for _, mode := range []string{"Karmada's own", "client-go's shared transport", "pool", "pool, keep-alive off"} {
			var rt func() (http.RoundTripper, error)
			switch mode {
			case "Karmada's own":
				rt = func() (http.RoundTripper, error) { return karmada(false), nil }
			case "client-go's shared transport":
				shared := karmada(true)
				defer shared.CloseIdleConnections()
				rt = func() (http.RoundTripper, error) { return shared, nil }
			default:
				p := newPool(t, WithKeepAlive(mode == "pool"))
				rt = func() (http.RoundTripper, error) { return p.TLSTransport(settings()) }
			}
			before := proxy.Stats().Tunnels
			ok, err := served(rt)
			got[mode] = ok
			tunnels := proxy.Stats().Tunnels - before
			t.Logf("attempt %d, %s: %d of %d lists due in %v served (%v); %d tunnels", attempt, mode, ok, n, due, err, tunnels)
			if tunnels < n {
				t.Errorf("attempt %d, %s: %d tunnels for %d lists sent at once, want one dialed for each", attempt, mode, tunnels, n)
			}
		}
		results = append(results, fmt.Sprint(got))
		allServed = got["Karmada's own"] == n && got["pool, keep-alive off"] == n
	}
	if !allServed {
		t.Errorf("6 lists through slow tunnels to a front of one stream, 3 attempts: %v; want keep-alive off to serve all, as Karmada's own transport", results)
	}
}
