package sharedtransport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestServerRestart: the server dies under load and comes back on the same
// port. Requests in flight fail with an error that names the request and
// what happened to it; requests sent once the server is back succeed; no
// connection is left stuck on either side.
func TestServerRestart(t *testing.T) {
	for _, keepAlive := range []bool{true, false} {
		t.Run(fmt.Sprintf("keep-alive %v", keepAlive), func(t *testing.T) {
			f := newFixture(t, testserver.Options{})
			p := newPool(t, WithKeepAlive(keepAlive))
			cfg := f.srv.RestConfig(f.alice)
			must(t, p.Wrap(cfg))
			// The HTTP client of the config, without the rest client's
			// retries, shows what the transport itself does.
			hc, err := rest.HTTPClientFor(cfg)
			must(t, err)
			target := f.srv.URL() + "/api/v1/nodes"

			var phase atomic.Int32
			stop := startRestartLoad(hc, target, &phase)

			time.Sleep(300 * time.Millisecond)
			// Requests held at the server when it dies are in flight.
			f.srv.SetLatency(time.Second)
			waitFor(t, "requests held at the server", func() bool { return f.srv.Delayed() > 0 })
			phase.Store(restartDown)
			must(t, f.srv.Stop())
			waitFor(t, "the pool sees every connection closed", func() bool { return p.Stats().OpenConns == 0 })
			time.Sleep(200 * time.Millisecond) // down for a while: new requests are refused
			f.srv.SetLatency(0)
			must(t, f.srv.Restart())
			phase.Store(restartBack)
			time.Sleep(300 * time.Millisecond)
			checkRestartResults(t, stop(), f.srv.Addr())

			// No stuck connections: the pool and the server agree, and
			// the server keeps at most one per identity with keep-alive.
			waitFor(t, "pool and server agree on open connections", func() bool {
				return p.Stats().OpenConns == f.srv.OpenConns() && f.srv.OpenConns() <= 1
			})
			if err := listNodes(context.Background(), cfg); err != nil {
				t.Errorf("a clientset after the restart: %v", err)
			}
			t.Logf("server after: %+v; pool: %+v", f.srv.Stats(), p.Stats())
		})
	}
}

// The phases of TestServerRestart: the server runs, is down, is back.
const (
	restartRunning = iota
	restartDown
	restartBack
)

// restartRequestTimeout bounds each request of startRestartLoad.
const restartRequestTimeout = 5 * time.Second

// restartResult is one request of startRestartLoad: the phases it started
// and ended in, its error and how long it took.
type restartResult struct {
	startPhase, endPhase int32
	err                  error
	took                 time.Duration
}

// startRestartLoad sends GET target with hc from 20 goroutines, each
// request noting the phase it started and ended in, until the returned stop
// is called; stop returns every request's result.
func startRestartLoad(hc *http.Client, target string, phase *atomic.Int32) (stop func() []restartResult) {
	var mu sync.Mutex
	var results []restartResult
	done := make(chan struct{})
	var wg sync.WaitGroup
	const workers = 20
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				r := restartResult{startPhase: phase.Load()}
				start := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), restartRequestTimeout)
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
				resp, err := hc.Do(req)
				if err == nil {
					// net/http's body errors name no request: the loop names
					// it, as client-go does when it reads a body.
					if _, err = io.Copy(io.Discard, resp.Body); err != nil {
						err = fmt.Errorf("reading the body of GET %s: %w", target, err)
					}
					resp.Body.Close()
					if err == nil && resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("status %s", resp.Status)
					}
				}
				cancel()
				r.err, r.took, r.endPhase = err, time.Since(start), phase.Load()
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if err != nil {
					time.Sleep(5 * time.Millisecond) // no busy loop while the server is down
				}
			}
		}()
	}
	return func() []restartResult {
		close(done)
		wg.Wait()
		return results
	}
}

// checkRestartResults checks startRestartLoad's results against a server
// at addr that was stopped and restarted: requests fail only while it is
// down or in flight when it dies, with a clear error and before their
// deadline.
func checkRestartResults(t *testing.T, results []restartResult, addr string) {
	t.Helper()
	var ok [3]int
	var failed [3][3]int // by start phase, end phase
	reasons := map[string]int{}
	quoted := regexp.QuoteMeta(addr)
	// An error from Do (a url.Error), or one reading a response whose
	// headers arrived before the server died.
	clear := regexp.MustCompile(`^(Get "https://` + quoted + `/api/v1/nodes"|reading the body of GET https://` + quoted + `/api/v1/nodes): .+`)
	for _, r := range results {
		if r.err == nil {
			ok[r.startPhase]++
			continue
		}
		failed[r.startPhase][r.endPhase]++
		reasons[reason(r.err)]++
		if r.startPhase == restartBack {
			t.Errorf("a request sent after the server was back failed: %v", r.err)
		}
		if r.endPhase == restartRunning {
			t.Errorf("a request failed before the server went down: %v", r.err)
		}
		if !clear.MatchString(r.err.Error()) {
			t.Errorf("unclear error: %v", r.err)
		}
		if errors.Is(r.err, context.DeadlineExceeded) || r.took >= restartRequestTimeout {
			t.Errorf("a request hung until its deadline: %v", r.err)
		}
	}
	inflight := failed[restartRunning][restartDown] + failed[restartRunning][restartBack]
	t.Logf("%d requests: %d ok before the stop, %d ok after the restart; failed: %d sent before the stop (in flight), %d sent during the stop or while down; reasons %v",
		len(results), ok[restartRunning], ok[restartBack], inflight, failed[restartDown][restartDown]+failed[restartDown][restartBack], sortedCounts(reasons))
	if ok[restartRunning] == 0 || ok[restartBack] == 0 {
		t.Errorf("no successful requests before (%d) or after (%d) the restart", ok[restartRunning], ok[restartBack])
	}
	if inflight == 0 {
		t.Errorf("no request was in flight when the server died: the test did not test that")
	}
}

// reason is the tail of an error message with addresses and ports removed,
// for counting kinds of errors.
func reason(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return regexp.MustCompile(`127\.0\.0\.1:\d+`).ReplaceAllString(err.Error(), "ADDR")
}

func sortedCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "[%dx %s] ", m[k], k)
	}
	return strings.TrimSpace(b.String())
}

// TestBlackHole: a connection that stops carrying bytes without closing (a
// dead peer, a firewall that dropped its state) is found by client-go's
// HTTP/2 health check, which the pool's transports keep, with its
// environment overrides; the next requests use new connections, dialed as
// net/http dials, and no request outlives its context.
func TestBlackHole(t *testing.T) {
	// Read by utilnet.SetTransportDefaults when the pool builds the
	// transport: a ping after 1 s without a frame, the connection closed
	// after 1 s more without an answer. client-go's defaults are 30 s and
	// 15 s.
	t.Setenv("HTTP2_READ_IDLE_TIMEOUT_SECONDS", "1")
	t.Setenv("HTTP2_PING_TIMEOUT_SECONDS", "1")
	f := newFixture(t, testserver.Options{})
	relay := newRelay(t, f.srv.Addr())
	p := newPool(t)
	cfg := f.srv.RestConfig(f.alice)
	cfg.Host = "https://" + relay.addr()
	cfg.QPS, cfg.Burst = 1e6, 1e6
	must(t, p.Wrap(cfg))
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	list := func(timeout time.Duration) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		start := time.Now()
		_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		return time.Since(start), err
	}
	for range 3 {
		if _, err := list(5 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if n := relay.accepted.Load(); n != 1 {
		t.Fatalf("warm-up used %d connections, want 1", n)
	}

	start := time.Now()
	if n := relay.blackhole(); n != 1 {
		t.Fatalf("black-holed %d connections, want 1", n)
	}
	// Requests sent into the black hole: short deadlines (before the health
	// check can act) and long ones.
	type result struct {
		timeout, took time.Duration
		err           error
	}
	var wg sync.WaitGroup
	results := make(chan result, 10)
	for i := range 10 {
		timeout := 700 * time.Millisecond
		if i%2 == 1 {
			timeout = 20 * time.Second
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			took, err := list(timeout)
			results <- result{timeout, took, err}
		}()
	}
	// Only the health check closes it: a request whose context ends leaves
	// an HTTP/2 connection open, and the long deadlines outlast waitFor's
	// bound, as do client-go's default 30 s + 15 s, so the overrides above
	// are what found it.
	waitFor(t, "the client closes the dead connection", func() bool { return relay.closedByClient.Load() >= 1 })
	detected := time.Since(start)
	wg.Wait()
	close(results)
	reasons := map[string]int{}
	var longest time.Duration
	for r := range results {
		longest = max(longest, r.took)
		if r.took > r.timeout+time.Second {
			t.Errorf("a request with a %v deadline took %v", r.timeout, r.took)
		}
		if r.err != nil {
			reasons[fmt.Sprintf("%v deadline: %s", r.timeout, reason(r.err))]++
		} else {
			reasons[fmt.Sprintf("%v deadline: ok", r.timeout)]++
		}
	}

	took, err := list(5 * time.Second)
	if err != nil {
		t.Fatalf("request after the dead connection was found: %v", err)
	}
	// The requests still waiting when the dead connection closed each dial,
	// as net/http dials for every request waiting: at most 5 (those with
	// the long deadline), and the last list finds one of theirs.
	if n := relay.accepted.Load(); n < 2 || n > 1+5 {
		t.Errorf("the relay accepted %d connections, want the dead one and, beside it, one to 5: a dial for each request waiting at most", n)
	}
	waitFor(t, "the pool counts one open connection", func() bool { return p.Stats().OpenConns == 1 })
	t.Logf("dead connection found after %v; requests into the hole: %s (longest %v); next request took %v on a new connection; pool %+v",
		detected.Round(time.Millisecond), sortedCounts(reasons), longest.Round(time.Millisecond), took.Round(time.Millisecond), p.Stats())
}

// TestGoaway: the server sends GOAWAY on 30% of responses (kube-apiserver's
// --goaway-chance) to 20 workers x 30 requests, each through a fresh config:
// every request succeeds. After a GOAWAY, Go's HTTP/2 client dials for the
// requests waiting at that moment, through the pool as through client-go
// alone, the control: about as many connections accepted and open at once
// (a median at most twice the control's most, the server counting), and
// the pool's count of open connections agrees with the server's at the end.
// The server counts a connection open until it has read the client's close,
// so a fixed bound per worker is one its own counting can break.
func TestGoaway(t *testing.T) {
	workers, requests := 20, 30
	if raceDetector() {
		requests = 10
	}
	peaks := map[string][]int{}
	connsAsClientGo(t, "GOAWAY on 30% of responses", 3, []string{"client-go alone", "pool"}, func(t *testing.T, mode string) uint64 {
		f := newFixture(t, testserver.Options{GoawayChance: 0.3})
		kubeconfig := f.kubeconfig(t, "alice", f.alice).Kubeconfig
		p := newPool(t)
		seedLoad(t, workers, requests, func() (kubernetes.Interface, error) {
			cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
			if err != nil {
				return nil, err
			}
			if mode != "pool" {
				return kubernetes.NewForConfig(cfg)
			}
			return wrapped(cfg, wrapFn(p))
		})
		st := f.srv.Stats()
		t.Logf("%d requests, all ok; server sent %d GOAWAYs, accepted %d connections, at most %d open at once",
			workers*requests, st.Goaways, st.Accepted, st.PeakOpen)
		if st.Goaways < uint64(workers*requests/5) {
			t.Errorf("only %d GOAWAYs: the test did not test that", st.Goaways)
		}
		peaks[mode] = append(peaks[mode], st.PeakOpen)
		if mode == "pool" {
			// A connection that got GOAWAY closes when its last stream ends.
			waitFor(t, "at most one connection left, counted alike by pool and server", func() bool {
				return p.Stats().OpenConns == f.srv.OpenConns() && f.srv.OpenConns() <= 1
			})
		}
		return st.Accepted
	})
	pool := slices.Clone(peaks["pool"])
	slices.Sort(pool)
	if control := slices.Max(peaks["client-go alone"]); pool[len(pool)/2] > 2*control {
		t.Errorf("at most %v connections open at once through the pool, %v through client-go alone: a median over twice client-go's most", peaks["pool"], peaks["client-go alone"])
	}
}

// TestCloseBesideHungDial: a request whose dial never answers (a dialer
// that waits for its context) fails with ErrClosed when the pool closes, as
// Close's doc says of requests in flight, rather than when its dial would
// time out (never, for this dialer; 30 s for client-go's).
func TestCloseBesideHungDial(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	dialing := make(chan struct{}, 1)
	cfg := f.srv.RestConfig(f.alice)
	cfg.Dial = func(ctx context.Context, _, _ string) (net.Conn, error) {
		dialing <- struct{}{}
		<-ctx.Done()
		return nil, ctx.Err()
	}
	p := newPool(t, WithDialIdentity(func(*rest.Config) string { return "hung dial" }))
	client := httpClient(t, p, cfg)
	done := make(chan error, 1)
	go func() {
		_, err := getUA(context.Background(), client, f.srv.URL(), "hung")
		done <- err
	}()
	<-dialing
	must(t, p.Close())
	select {
	case err := <-done:
		t.Logf("a request whose dial hung, once the pool closed: %v", err)
		if !errors.Is(err, ErrClosed) {
			t.Errorf("a request whose dial hung failed with %v once the pool closed, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a request whose dial hangs still waits 10 s after Close")
	}
}
