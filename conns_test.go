package sharedtransport

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Tests of the connection layer (internal/conns) through the pool: it
// dials as client-go dials, so connection counts are compared with
// client-go's best case (one transport for every request) in the same test,
// and response bodies hold their place until they end.

// connsAsClientGo runs count runs times for each of modes, the first
// client-go's best case, interleaved, and fails t when a later mode's median
// of the connections the server accepted is more than twice the most the
// first accepted in a run. Both dial as net/http dials: a request that finds
// no free stream dials, so a cold burst's count varies from run to run, and
// widely (the first connection is ready before most requests dial, or not:
// client-go alone accepted 3, 40 and 100 for one burst of 100).
func connsAsClientGo(t *testing.T, what string, runs int, modes []string, count func(t *testing.T, mode string) uint64) {
	t.Helper()
	accepted := map[string][]uint64{}
	for i := range runs {
		for _, mode := range modes {
			t.Run(fmt.Sprintf("%s/%d", mode, i), func(t *testing.T) { accepted[mode] = append(accepted[mode], count(t, mode)) })
		}
	}
	median := func(mode string) uint64 {
		got := slices.Clone(accepted[mode])
		slices.Sort(got)
		return got[len(got)/2]
	}
	control := slices.Max(accepted[modes[0]])
	for _, mode := range modes {
		t.Logf("%s, %s: the server accepted %v connections, median %d", what, mode, accepted[mode], median(mode))
		if m := median(mode); m > 2*control {
			t.Errorf("%s, %s: a median of %d connections accepted, more than twice the most %s accepted in a run (%d)", what, mode, m, modes[0], control)
		}
	}
}

// TestColdStartBurst: a burst of first requests through one new client
// dials as client-go's does, each request waiting dialing its own, and
// every request is served.
func TestColdStartBurst(t *testing.T) {
	for _, n := range []int{100, 300} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			connsAsClientGo(t, fmt.Sprintf("a burst of %d first requests", n), 5, []string{"client-go alone", "pool"}, func(t *testing.T, mode string) uint64 {
				f := newFixture(t, testserver.Options{})
				cfg := f.srv.RestConfig(f.alice)
				if mode == "pool" {
					burst(t, wrappedClient(t, newPool(t), cfg), n)
				} else {
					cfg.QPS = -1
					cs, err := kubernetes.NewForConfig(cfg)
					must(t, err)
					burst(t, cs, n)
				}
				return f.srv.Stats().Accepted
			})
		})
	}
}

// TestLoadAtTheStreamCount: once a first list opened a connection, 101
// clients that each send their next list as soon as the last one ends,
// against a server allowing 100 streams per connection: every list is
// served, over as many connections as client-go alone opens (two: the
// 101st stream needs a second).
func TestLoadAtTheStreamCount(t *testing.T) {
	clients, each := 101, 60
	if raceDetector() {
		each = 20
	}
	connsAsClientGo(t, fmt.Sprintf("%d clients x %d lists", clients, each), 3, []string{"client-go alone", "pool"}, func(t *testing.T, mode string) uint64 {
		f := newFixture(t, testserver.Options{Latency: 5 * time.Millisecond})
		cfg := f.srv.RestConfig(f.alice)
		var cs kubernetes.Interface
		if mode == "pool" {
			cs = wrappedClient(t, newPool(t), cfg)
		} else {
			cfg.QPS = -1
			var err error
			cs, err = kubernetes.NewForConfig(cfg)
			must(t, err)
		}
		list := func(int, int) error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			return err
		}
		requireNoErrors(t, runClients(1, 1, list)) // the first list opens a connection
		requireNoErrors(t, runClients(clients, each, list))
		return f.srv.Stats().Accepted
	})
}

// TestSeedLoadBesideWatch: the seed's load, 99 workers each sending its
// lists through a fresh config and clientset, beside a watch, against a
// server allowing 100 streams per connection and taking 50 ms over each
// list, so that the workers' lists overlap, once a first list has opened a
// connection. client-go's best case, the control, is configs without Proxy,
// which its cache keys alike: one transport, whose one connection carries
// every request. Through the pool, with Wrap and with HTTPClientFor of
// configs with a Proxy function (Karmada's member clusters, which client-go
// alone gives a transport each), the same. (A cold start dials as net/http
// dials, whose counts vary from run to run: TestColdStartBurst, and
// conncount's medians.)
func TestSeedLoadBesideWatch(t *testing.T) {
	const workers = 99 // and the watch: the connection's 100 streams
	requests := 20
	if raceDetector() {
		requests = 4
	}
	modes := []string{"client-go's best case", "pool, Wrap", "pool, HTTPClientFor with Proxy"}
	accepted := map[string]uint64{}
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t, testserver.Options{Latency: 50 * time.Millisecond})
			p := newPool(t)
			newClient := func() (kubernetes.Interface, error) {
				cfg := f.srv.RestConfig(f.alice)
				cfg.QPS = -1
				switch mode {
				case "pool, Wrap":
					return wrapped(cfg, wrapFn(p))
				case "pool, HTTPClientFor with Proxy":
					cfg.Proxy = nilProxy
					return pooledClientset(p, cfg)
				}
				return kubernetes.NewForConfig(cfg)
			}
			seedLoad(t, 1, 1, newClient) // the first list opens the connection
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			watching := make(chan error, 1)
			go func() { // with the load, as a controller starting up
				cs, err := newClient()
				if err == nil {
					var w watch.Interface
					if w, err = cs.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{}); err == nil {
						defer w.Stop()
					}
				}
				watching <- err
				<-ctx.Done()
			}()
			seedLoad(t, workers, requests, newClient)
			must(t, <-watching)
			st := f.srv.Stats()
			accepted[mode] = st.Accepted
			t.Logf("%s: a watch and %d workers x %d lists, each through a fresh config: the server accepted %d connections, peak open %d", mode, workers, requests, st.Accepted, st.PeakOpen)
		})
	}
	for _, mode := range modes[1:] {
		if accepted[mode] > max(accepted[modes[0]], 1) {
			t.Errorf("%s: %d connections accepted, client-go's best case %d", mode, accepted[mode], accepted[modes[0]])
		}
	}
}

// wrappedClient wraps cfg with p and returns a clientset without client-side
// rate limiting: the load is the point.
func wrappedClient(t testing.TB, p *Pool, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	cfg.QPS = -1
	must(t, p.Wrap(cfg))
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	return cs
}

// burst sends n node lists through cs all at once and fails t if any fails.
func burst(t testing.TB, cs kubernetes.Interface, n int) {
	t.Helper()
	requireNoErrors(t, runClients(n, 1, func(int, int) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		return err
	}))
}

// httpClient returns an HTTP client of cfg over p, for requests whose
// headers a test sets itself: built by client-go from cfg wrapped, or by
// HTTPClientFor for a config with a Proxy or Dial.
func httpClient(t testing.TB, p *Pool, cfg *rest.Config) *http.Client {
	t.Helper()
	if cfg.Proxy != nil || cfg.Dial != nil {
		c, err := p.HTTPClientFor(cfg) // Wrap passes such a config through
		must(t, err)
		return c
	}
	must(t, p.Wrap(cfg))
	c, err := rest.HTTPClientFor(cfg)
	must(t, err)
	return c
}

// getUA lists nodes at base through client with the given User-Agent, reads
// the body to its end and closes it, and returns the response's protocol.
func getUA(ctx context.Context, client *http.Client, base, ua string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/v1/nodes", nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("User-Agent", ua)
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", base, resp.Status)
	}
	return resp.Proto, nil
}

// concurrentGets sends n lists at once and returns the protocols the
// responses came over, counted, or the first error.
func concurrentGets(ctx context.Context, client *http.Client, base, ua string, n int) (map[string]int, error) {
	var mu sync.Mutex
	protos := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			proto, err := getUA(ctx, client, base, ua)
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			protos[proto]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	return protos, <-errs
}

// sendHeld sends n lists at once to base through client, each held by the
// server under hold, and returns release: it releases every held request,
// waits for all n and fails t on the first error.
func sendHeld(ctx context.Context, t testing.TB, hold *requestHold, client *http.Client, base string, n int) (release func()) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := getUA(ctx, client, base, "hold"); err != nil {
				errs <- err
			}
		}()
	}
	return func() {
		t.Helper()
		hold.releaseAll()
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
}

// wantSharedHTTP2 sends n lists at once to base through client and fails t
// unless every one went over HTTP/2 and srv accepted at most newConns
// connections meanwhile (fewer when a connection open before, a dial that
// raced a failover say, carried them).
func wantSharedHTTP2(ctx context.Context, t testing.TB, client *http.Client, base string, srv *testserver.Server, n int, newConns uint64, what string) {
	t.Helper()
	before := srv.Stats().Accepted
	protos, err := concurrentGets(ctx, client, base, what, n)
	accepted := srv.Stats().Accepted - before
	t.Logf("%s: %d concurrent lists: %v %v over %d new connections", what, n, protos, err, accepted)
	if err != nil || protos["HTTP/2.0"] != n || accepted > newConns {
		t.Errorf("%s: %d concurrent lists: %v %v over %d new connections, want all HTTP/2 over at most %d", what, n, protos, err, accepted, newConns)
	}
}

// protocolBackends are two servers of one CA behind one relay address: one
// speaking HTTP/2, one HTTP/1.1 only.
type protocolBackends struct {
	h2, h1 *testserver.Server
	relay  *switchRelay
}

func newProtocolBackends(t testing.TB, f *fixture) *protocolBackends {
	t.Helper()
	serving, err := f.ca.IssueServer()
	must(t, err)
	b := &protocolBackends{}
	for _, s := range []struct {
		srv     **testserver.Server
		disable bool
	}{{&b.h2, false}, {&b.h1, true}} {
		srv := f.startServer(t, testserver.Options{ServerCert: serving, DisableHTTP2: s.disable})
		*s.srv = srv
	}
	b.relay = newSwitchRelay(t, b.h2.Addr())
	return b
}

func (b *protocolBackends) url() string { return "https://" + b.relay.addr() }

// TestProtocolSwitch: a backend fails over from HTTP/2 to HTTP/1.1 at the
// same address and back. Over HTTP/1.1, concurrent watches each run at once
// (no request queues behind another's watch); when HTTP/2 is back, a burst
// after the first response shares its connection again.
func TestProtocolSwitch(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	b := newProtocolBackends(t, f)
	p := newPool(t)
	cfg := f.srv.RestConfig(f.alice)
	cfg.Host = b.url()
	client := httpClient(t, p, rest.CopyConfig(cfg))
	cs := wrappedClient(t, p, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if protos, err := concurrentGets(ctx, client, b.url(), "before", 40); err != nil || protos["HTTP/2.0"] != 40 {
		t.Fatalf("before the switch: %v %v", protos, err)
	}

	// The burst dialed for every list waiting, as client-go does; a dial
	// still under way at the switch would meet the HTTP/2 backend's end
	// cut before its settings arrived. Switch once every dial is done.
	waitFor(t, "the burst's dials done", func() bool {
		before := p.Stats()
		time.Sleep(50 * time.Millisecond)
		st := p.Stats()
		return st.Dials == before.Dials && st.Handshakes+st.Resumptions == st.Dials
	})
	b.relay.switchTo(b.h1.Addr())
	// The failover cut every connection: wait until the pool saw it (a dial
	// that raced the switch reached the new backend and stays).
	waitFor(t, "the pool sees its connections to the HTTP/2 backend closed", func() bool { return p.Stats().OpenConns == b.relay.open() })
	const watches = 5
	started := make(chan watch.Interface, watches)
	for range watches {
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			w, err := cs.CoreV1().Nodes().Watch(wctx, metav1.ListOptions{})
			if err != nil {
				t.Errorf("watch over HTTP/1.1: %v", err)
				started <- nil
				return
			}
			started <- w
			for range w.ResultChan() { // a watch's reader, as an informer's
			}
		}()
	}
	running := 0
	for range watches {
		if w := <-started; w != nil {
			running++
			defer w.Stop()
		}
	}
	protos, err := concurrentGets(ctx, client, b.url(), "on HTTP/1.1", 40)
	t.Logf("HTTP/1.1 backend: %d of %d watches started together; 40 lists beside them: %v %v; accepted %d", running, watches, protos, err, b.h1.Stats().Accepted)
	if err != nil {
		t.Errorf("lists beside watches over HTTP/1.1: %v", err)
	}

	b.relay.switchTo(b.h2.Addr())
	waitFor(t, "the pool sees its connections to the HTTP/1.1 backend closed", func() bool { return p.Stats().OpenConns == b.relay.open() })
	// The first list after the switch dials; the burst after it finds
	// that connection open, as with client-go alone.
	if proto, err := getUA(ctx, client, b.url(), "HTTP/2 is back"); err != nil || proto != "HTTP/2.0" {
		t.Fatalf("the first list after HTTP/2 came back: %s %v", proto, err)
	}
	wantSharedHTTP2(ctx, t, client, b.url(), b.h2, 40, 1, "after HTTP/2 came back")
}

// upgradeEcho sends an upgrade request for proto (websocket, SPDY/3.1) to
// url through rt, checks the 101, and that what it writes on the upgraded
// connection comes back.
func upgradeEcho(ctx context.Context, rt http.RoundTripper, url, proto string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/api/v1/namespaces/kube-system/pods/kube-proxy-0/exec", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", proto)
	if proto == "websocket" {
		req.Header.Set("Sec-WebSocket-Version", "13")
		req.Header.Set("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
		req.Header.Set("Sec-WebSocket-Protocol", "v5.channel.k8s.io")
	} else {
		req.Header.Set("X-Stream-Protocol-Version", "v4.channel.k8s.io")
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		return fmt.Errorf("upgrade answered %s: %s", resp.Status, b)
	}
	conn, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		return fmt.Errorf("the 101 response's body (%T) is not writable", resp.Body)
	}
	const payload = "stdin of an exec session"
	if _, err := io.WriteString(conn, payload); err != nil {
		return err
	}
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(conn, got); err != nil {
		return err
	}
	if string(got) != payload {
		return fmt.Errorf("the upgraded connection echoed %q", got)
	}
	return nil
}

// reverseProxyFront is a multi-cluster front in its simplest form: an
// httputil.ReverseProxy to target over rt, upgrades included.
func reverseProxyFront(t testing.TB, target string, rt http.RoundTripper) string {
	t.Helper()
	return proxyFrontFunc(t, target, rt, func(error) {})
}

// TestUpgrades: websocket and SPDY upgrades through a transport from a
// wrapped config (rest.TransportFor), sent directly and through a reverse
// proxy front. Each works (the 101's body is
// writable), takes no stream slot, and says nothing about HTTP/2: a burst
// after them stays on the one HTTP/2 connection. client-go alone is the
// control.
func TestUpgrades(t *testing.T) {
	for _, mode := range []string{"client-go", "pool"} {
		for _, proto := range []string{"websocket", "SPDY/3.1"} {
			for _, via := range []string{"direct", "reverse proxy"} {
				t.Run(strings.Join([]string{mode, proto, via}, ", "), func(t *testing.T) {
					f := newFixture(t, testserver.Options{})
					cfg := f.srv.RestConfig(f.alice)
					const upgrades = 3
					if mode == "pool" {
						must(t, newPool(t).Wrap(cfg))
					}
					rt, err := rest.TransportFor(cfg)
					must(t, err)
					defer utilnet.CloseIdleConnectionsFor(rt)
					client := &http.Client{Transport: rt}
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if protos, err := concurrentGets(ctx, client, f.srv.URL(), "before", 30); err != nil || protos["HTTP/2.0"] != 30 {
						t.Fatalf("before the upgrades: %v %v", protos, err)
					}
					target, upgradeRT := f.srv.URL(), rt
					if via == "reverse proxy" {
						target, upgradeRT = reverseProxyFront(t, f.srv.URL(), rt), &http.Transport{}
					}
					failed := 0
					var firstErr error
					for range upgrades {
						if err := upgradeEcho(ctx, upgradeRT, target, proto); err != nil {
							failed++
							if firstErr == nil {
								firstErr = err
							}
						}
					}
					st := f.srv.Stats()
					t.Logf("%d upgrades, %d failed (%v); server: %d accepted, %d upgrades", upgrades, failed, firstErr, st.Accepted, st.Upgrades)
					if mode == "client-go" && proto != "websocket" && failed == upgrades {
						// Go sends only websocket upgrades over HTTP/1.1 on its
						// own; client-go's transport offers a SPDY upgrade to its
						// HTTP/2 connection, which refuses it.
						t.Logf("client-go alone cannot send this upgrade: %v", firstErr)
					} else if failed > 0 {
						t.Errorf("%d of %d upgrades failed: %v", failed, upgrades, firstErr)
					}
					newConns := uint64(0)
					if mode == "client-go" {
						// The control's burst is logged, not held: how many
						// connections client-go alone opens for it after a
						// refused upgrade depends on Go's HTTP/2 (under Go
						// 1.27, 28 once).
						newConns = math.MaxUint64
					}
					wantSharedHTTP2(ctx, t, client, f.srv.URL(), f.srv, 90, newConns, "after the upgrades")
				})
			}
		}
	}
}

// TestBodyKeepsIdentity: a watch or a followed log whose clientset and config
// were dropped keeps its identity, and its connection, alive: with a short
// idle timeout and garbage collections forced, it goes on delivering.
func TestBodyKeepsIdentity(t *testing.T) {
	f := newFixture(t, testserver.Options{BookmarkInterval: 50 * time.Millisecond, LogInterval: 50 * time.Millisecond})
	for _, kind := range []string{"watch", "log stream"} {
		t.Run(kind, func(t *testing.T) {
			p := newPool(t, WithIdleTimeout(10*time.Millisecond))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var events atomic.Int64
			ended := make(chan struct{})
			// Only the result channel or the stream outlives this function.
			func() {
				cs := wrappedClient(t, p, f.srv.RestConfig(f.alice))
				if kind == "watch" {
					w, err := cs.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{AllowWatchBookmarks: true})
					must(t, err)
					go func() {
						defer close(ended)
						for range w.ResultChan() {
							events.Add(1)
						}
					}()
					return
				}
				stream, err := cs.CoreV1().Pods("kube-system").GetLogs("kube-proxy-0", &corev1.PodLogOptions{Follow: true}).Stream(ctx)
				must(t, err)
				go func() {
					defer close(ended)
					defer stream.Close()
					sc := bufio.NewScanner(stream)
					for sc.Scan() {
						events.Add(1)
					}
				}()
			}()
			// Collect for longer than the idle timeout many times over; then
			// the stream must still deliver, and its identity still be there.
			for range 30 {
				runtime.GC()
				select {
				case <-ended:
					t.Fatalf("the %s ended after %d events once its clientset was unreachable (identities %d)", kind, events.Load(), p.Stats().Identities)
				case <-time.After(100 * time.Millisecond):
				}
			}
			after := events.Load()
			waitFor(t, "5 more events after the forced collections", func() bool {
				runtime.GC()
				select {
				case <-ended:
					t.Fatalf("the %s ended after %d events once its clientset was unreachable", kind, events.Load())
				default:
				}
				return events.Load() >= after+5
			})
			t.Logf("%s: %d events across forced GCs; identities %d, server open connections %d",
				kind, events.Load(), p.Stats().Identities, f.srv.Stats().Open)
			if n := p.Stats().Identities; n != 1 {
				t.Errorf("%s: %d identities while its stream runs, want 1", kind, n)
			}
			cancel()
			<-ended
		})
	}
}

// heldDialRotation is a pool with WithDrainTimeout(0) over alice's files in a
// secret volume, and a config of them whose first dial is held until release
// closes: a request in that dial outlives the rotation to dave.
type heldDialRotation struct {
	f       *fixture
	rec     *cnRecorder
	dave    *testserver.KeyPair
	p       *Pool
	d       *certDir
	cfg     *rest.Config
	dials   atomic.Int64
	release chan struct{}
}

func newHeldDialRotation(t testing.TB) *heldDialRotation {
	t.Helper()
	h := &heldDialRotation{rec: &cnRecorder{}, release: make(chan struct{})}
	h.f = newFixture(t, testserver.Options{OnRequest: h.rec.record})
	var err error
	if h.dave, err = h.f.ca.IssueClient("dave"); err != nil {
		t.Fatal(err)
	}
	h.p = newPool(t, WithPollInterval(0), WithDrainTimeout(0), WithDialIdentity(func(*rest.Config) string { return "held first dial" }))
	h.d = newCertDir(t, secretVolume, h.f.alice, h.f.ca.CertPEM())
	h.cfg = h.d.config(h.f.srv.URL())
	h.cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if h.dials.Add(1) == 1 {
			<-h.release
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	return h
}

// rotateDuringDial waits for the held first dial, then rotates the files to
// dave and waits for the pool to see it.
func (h *heldDialRotation) rotateDuringDial(t testing.TB, what string) {
	t.Helper()
	waitFor(t, what, func() bool { return h.dials.Load() == 1 })
	h.d.write(t, h.dave, h.f.ca.CertPEM())
	waitFor(t, "rotation", func() bool { return h.p.Stats().Rotations == 1 })
}

// TestRetiredGenerationRetried: with WithDrainTimeout(0), a request whose
// dial outlives the rotation is sent with the new certificate, and ErrClosed
// stays the error of a closed pool.
func TestRetiredGenerationRetried(t *testing.T) {
	h := newHeldDialRotation(t)
	f, rec, p, cfg := h.f, h.rec, h.p, h.cfg
	// HTTPClientFor: the identity is the config's own (it has a Dial, which
	// Wrap passes through), so the request is the pool's to send on the new
	// generation.
	client, err := p.HTTPClientFor(cfg)
	must(t, err)
	result := make(chan error, 1)
	go func() {
		_, err := getUA(context.Background(), client, f.srv.URL(), "dials across a rotation")
		result <- err
	}()
	h.rotateDuringDial(t, "the first dial starts")
	// The request is checked again before it is resent: past client-go's
	// one-second cache of the files, client-go's transport for the config
	// presents dave too, so the request may go with the new material.
	time.Sleep(certSettle + 300*time.Millisecond)
	close(h.release)
	err = <-result
	t.Logf("a request whose dial outlived the rotation: %v; server saw %v", err, rec.cns())
	if err != nil {
		t.Errorf("a request whose generation retired before it was sent failed: %v (errors.Is ErrClosed: %v)", err, errors.Is(err, ErrClosed))
	}
	if got := rec.cns(); got["dave"] != 1 || got["alice"] != 0 {
		t.Errorf("the server saw %v, want the request once, with the new certificate", got)
	}
	p.Close()
	if _, err := getUA(context.Background(), client, f.srv.URL(), "closed"); !errors.Is(err, ErrClosed) {
		t.Errorf("a request through a closed pool: %v, want ErrClosed", err)
	}
}

// TestFullConnectionGrows: when every stream of the host's HTTP/2 connection
// is held by a request the server has not answered (watches, slow lists),
// requests beyond them dial rather than wait for a stream of the first: the
// server holds all 101 or 150 at once, through the pool as through
// client-go alone, over about as many connections.
func TestFullConnectionGrows(t *testing.T) {
	for _, n := range []int{101, 150} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			connsAsClientGo(t, fmt.Sprintf("%d requests held by the server", n), 3, []string{"client-go alone", "pool"}, func(t *testing.T, mode string) uint64 {
				hold := newRequestHold(t)
				f := newFixture(t, testserver.Options{OnRequest: hold.onRequest})
				cfg := f.srv.RestConfig(f.alice)
				client := clientGoClient(t, cfg)
				if mode == "pool" {
					client = httpClient(t, newPool(t), cfg)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				release := sendHeld(ctx, t, hold, client, f.srv.URL(), n)
				waitFor(t, "the server holds every request", func() bool { return hold.held.Load() == int64(n) })
				accepted := f.srv.Stats().Accepted
				release()
				return accepted
			})
		})
	}
}
