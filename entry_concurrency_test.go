package sharedtransport

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestConcurrency races Wrap, requests, rotations of watched files, garbage
// collection of identities and Close against each other, pool after pool
// (a subtest each), for about five seconds. Run it under -race. In each
// round every client completes requests before Close starts, and every Wrap
// and request ends one of two ways: it succeeds, or, once Close has started,
// it fails with ErrClosed. (A request of a certificate-files config that
// client-go's own transport carries may also be cut by that transport's own
// rotation, as it would be without the pool; see filesRequest.) Once Close
// has returned, Wrap and the requests of clients that only the pool can
// carry fail with ErrClosed. Every request carries the certificate its
// config holds. Goroutines (goleak in TestMain) and file descriptors come
// back to where they were.
func TestConcurrency(t *testing.T) {
	total := 5 * time.Second
	if testing.Short() {
		total = time.Second
	}
	h := newRaceHarness(t)
	h.round(t, 200*time.Millisecond) // warm-up: lazily opened descriptors exist from now on
	h.closeOthers(t)
	baseline := countFDs(t)

	var sum raceTally
	start := time.Now()
	for i := 0; time.Since(start) < total; i++ {
		t.Run(fmt.Sprintf("round %d", i), func(t *testing.T) { sum.add(h.round(t, time.Second)) })
	}
	t.Logf("%v: %s", time.Since(start).Round(time.Millisecond), &sum)

	t.Run("file descriptors back to the baseline", func(t *testing.T) {
		h.closeOthers(t)
		var fds int
		waitFor(t, "file descriptors back to the baseline", func() bool { fds = countFDs(t); return fds <= baseline })
		t.Logf("fds %d -> %d", baseline, fds)
	})
	t.Run("every request carried its own certificate", func(t *testing.T) {
		if n := h.violations.Load(); n > 0 {
			t.Errorf("%d requests carried the wrong certificate; first: %v", n, h.firstViolation.Load())
		}
	})
}

// raceHarness is what every round of TestConcurrency shares: the server,
// which checks every request's certificate, and the configs' material.
type raceHarness struct {
	f        *fixture
	proxy    *connectProxy
	versions []*testserver.KeyPair // alice's certificate over one key: every mix read from disk is a pair
	bundles  [][]byte
	files    *certDir
	configs  atomic.Int64

	violations     atomic.Int64
	firstViolation atomic.Value
}

func newRaceHarness(t *testing.T) *raceHarness {
	h := &raceHarness{}
	// Every request spends a moment at the server, so that Close finds
	// requests in flight to cut.
	h.f = newFixture(t, testserver.Options{OnRequest: h.checkCertificate, Latency: 2 * time.Millisecond})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	h.proxy = newConnectProxy(t)
	for i := range 8 {
		h.versions = append(h.versions, issueForKey(t, h.f.ca, fmt.Sprintf("alice-v%d", i), h.f.alice))
	}
	h.bundles = [][]byte{h.f.ca.CertPEM(), append(h.f.ca.CertPEM(), otherCA.CertPEM()...)}
	h.files = writeCredFiles(t, filepath.Join(h.f.dir, "race"), h.bundles[0], h.versions[0])
	return h
}

func (h *raceHarness) checkCertificate(ri testserver.RequestInfo) {
	tg, cn, ok := parseTag(ri.UserAgent)
	if !ok {
		return
	}
	okCN := ri.CertCN == cn
	if tg == "files" {
		okCN = strings.HasPrefix(ri.CertCN, "alice-v") // rotating: any version of alice
	}
	if !okCN {
		h.violations.Add(1)
		h.firstViolation.CompareAndSwap(nil, fmt.Sprintf("config %s got a connection authenticated as %q", tg, ri.CertCN))
	}
}

// The kinds of config a round uses.
var raceKinds = []string{"files", "alice", "bob", "proxied"}

// newConfig returns a fresh config of kind: certificate files that rotate,
// alice or bob inline, or carol through a CONNECT proxy under a user name of
// its own, a new identity every time (the proxy ignores the user name),
// collected once dropped.
func (h *raceHarness) newConfig(kind string) *rest.Config {
	var cfg *rest.Config
	switch kind {
	case "files":
		cfg = h.files.config(h.f.srv.URL())
		tag(cfg, "files", "")
	case "alice":
		cfg = h.f.srv.RestConfig(h.f.alice)
		tag(cfg, "alice", "alice")
	case "bob":
		cfg = h.f.srv.RestConfig(h.f.bob)
		tag(cfg, "bob", "bob")
	default:
		cfg = h.f.srv.RestConfig(h.f.carol)
		u, _ := url.Parse(h.proxy.url())
		u.User = url.User(fmt.Sprintf("u%d", h.configs.Add(1)))
		cfg.Proxy = http.ProxyURL(u)
		tag(cfg, "proxied", "carol")
	}
	cfg.QPS, cfg.Burst = 1e6, 1e6
	return cfg
}

// closeOthers closes connections the pool does not own: a file config whose
// files changed since the pool last read them is passed through to
// client-go's own transport (its material differs), and client-go keeps
// those idle.
func (h *raceHarness) closeOthers(t *testing.T) {
	h.f.srv.CloseClientConnections()
	waitFor(t, "server connections closed", func() bool { return h.f.srv.OpenConns() == 0 })
}

// Where a round is, for each Wrap and request to be judged by.
const (
	running = iota
	closing // Close called
	closed  // Close returned
)

// raceTally counts how a round's calls ended.
type raceTally struct {
	wraps, requests, beforeClose, closedErrs, afterClosedErrs, clientGoCuts, rotations, gcs, passThrough int64
}

func (s *raceTally) add(o raceTally) {
	s.wraps += o.wraps
	s.requests += o.requests
	s.beforeClose += o.beforeClose
	s.closedErrs += o.closedErrs
	s.afterClosedErrs += o.afterClosedErrs
	s.clientGoCuts += o.clientGoCuts
	s.rotations += o.rotations
	s.gcs += o.gcs
	s.passThrough += o.passThrough
}

func (s *raceTally) String() string {
	return fmt.Sprintf("%d Wraps and %d requests succeeded (%d requests before Close started), %d failed with ErrClosed once Close started "+
		"(%d of them sent after it returned), %d cut by client-go's own transport as it rotated, %d rotations written, %d GCs, %d pass-throughs",
		s.wraps, s.requests, s.beforeClose, s.closedErrs, s.afterClosedErrs, s.clientGoCuts, s.rotations, s.gcs, s.passThrough)
}

// raceRound is one pool's life in TestConcurrency.
type raceRound struct {
	h     *raceHarness
	p     *Pool
	ctx   context.Context
	phase atomic.Int32
	stop  chan struct{}
	wg    sync.WaitGroup

	mu         sync.Mutex // guards the fields below
	tally      raceTally
	started    int64            // Wraps and requests started
	ended      int64            // Wraps and requests that returned
	progress   map[string]int64 // requests that succeeded before Close, per loop
	afterClose map[string]int64 // Wraps and requests started after Close returned, per loop
	unexpected map[string]int64 // message -> count
}

// round runs one pool for about length and then closes it under load.
func (h *raceHarness) round(t *testing.T, length time.Duration) raceTally {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r := &raceRound{h: h, p: New(WithIdleTimeout(0), withDebounce(time.Millisecond), WithPollInterval(20*time.Millisecond)),
		ctx: ctx, stop: make(chan struct{}), progress: map[string]int64{}, afterClose: map[string]int64{}, unexpected: map[string]int64{}}
	for i := range 4 {
		r.spawnFresh(fmt.Sprintf("fresh configs %d", i))
	}
	for _, kind := range raceKinds {
		r.spawnLongLived(t, kind)
	}
	r.spawnChurn(t)

	time.Sleep(length * time.Duration(50+rand.IntN(40)) / 100)
	r.await(t, "a request succeeded before Close", r.progress)
	r.closeUnderLoad(t)

	// A connection dialed by a request that raced Close must be closed too,
	// not left for the server's or the idle timeout.
	deadline := time.Now().Add(5 * time.Second)
	for r.p.Stats().OpenConns != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := r.p.Stats(); st.OpenConns != 0 {
		t.Errorf("a closed pool still counts %d open connections", st.OpenConns)
	}
	r.tally.passThrough = int64(r.p.Stats().PassThrough)
	r.check(t)
	return r.tally
}

// spawn runs fn in a loop until the round stops.
func (r *raceRound) spawn(fn func(rnd *rand.Rand)) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		rnd := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
		for {
			select {
			case <-r.stop:
				return
			default:
			}
			fn(rnd)
		}
	}()
}

// spawnFresh wraps fresh configs of every kind, uses each once, and drops it.
func (r *raceRound) spawnFresh(loop string) {
	r.mu.Lock()
	r.progress[loop] = 0
	r.mu.Unlock()
	r.spawn(func(rnd *rand.Rand) {
		kind := raceKinds[rnd.IntN(len(raceKinds))]
		cfg := r.h.newConfig(kind)
		start := r.begin()
		cs, err := declaredClientset(r.p, cfg, WithPerRequestWrappers()) // the tag leaves connections alone
		r.end(start, "Wrap", loop, wrapCall, err)
		if err != nil {
			return
		}
		start = r.begin()
		call := anyRequest
		if kind == "files" {
			call = filesRequest
		}
		r.end(start, "request on a fresh config", loop, call, r.list(cs))
	})
}

// spawnLongLived builds one client of kind and sends requests through it
// from two loops. Inline identities never rotate, so only the pool carries
// their requests, and once Close has returned each must fail.
func (r *raceRound) spawnLongLived(t *testing.T, kind string) {
	cfg := r.h.newConfig(kind)
	cs, err := declaredClientset(r.p, cfg, WithPerRequestWrappers())
	must(t, err)
	call := poolRequest
	if kind == "files" {
		call = filesRequest // a files client may be handed back to client-go's transport
	}
	for i := range 2 {
		loop := fmt.Sprintf("long-lived %s client, loop %d", kind, i)
		r.mu.Lock()
		r.progress[loop] = 0
		r.mu.Unlock()
		r.spawn(func(*rand.Rand) {
			start := r.begin()
			r.end(start, "request on a long-lived "+kind+" client", loop, call, r.list(cs))
		})
	}
}

// spawnChurn rotates the certificate and the CA bundle, collects garbage
// (and so unreferenced identities), and reads Stats.
func (r *raceRound) spawnChurn(t *testing.T) {
	files := r.h.files
	r.spawn(func(rnd *rand.Rand) {
		writeAtomic(t, files.cert, r.h.versions[rnd.IntN(len(r.h.versions))].CertPEM)
		writeAtomic(t, files.ca, r.h.bundles[rnd.IntN(len(r.h.bundles))])
		r.count(func(s *raceTally) { s.rotations++ })
		time.Sleep(time.Duration(5+rnd.IntN(20)) * time.Millisecond)
	})
	r.spawn(func(rnd *rand.Rand) {
		runtime.GC()
		r.count(func(s *raceTally) { s.gcs++ })
		time.Sleep(time.Duration(rnd.IntN(10)) * time.Millisecond)
	})
	r.spawn(func(*rand.Rand) {
		_ = r.p.Stats()
		time.Sleep(time.Millisecond)
	})
}

func (r *raceRound) list(cs *kubernetes.Clientset) error {
	_, err := cs.CoreV1().Nodes().List(r.ctx, metav1.ListOptions{})
	return err
}

// begin counts a Wrap or request as started and returns the phase it
// started in.
func (r *raceRound) begin() int32 {
	r.mu.Lock()
	r.started++
	r.mu.Unlock()
	return r.phase.Load()
}

// What a call of a round is, for end to judge how it may end.
type raceCall int

const (
	wrapCall    raceCall = iota // a Pool.Wrap
	poolRequest                 // a request through a client only the pool carries
	anyRequest                  // a request client-go's own transport may carry (its config passed through)
	// filesRequest is an anyRequest of a config with certificate files.
	// client-go's own transport for such a config closes all its
	// connections, requests in flight on them included, when a handshake
	// finds the certificate file changed (its dynamicClientCert), as it
	// does without the pool: see cutByClientGoRotation.
	filesRequest
)

// cutByClientGoRotation reports whether err is how a request fails when
// client-go's certificate rotation closes its connection: the request
// writing on it sees the closed connection, and HTTP/2 then closes the
// client connection with the others' streams on it.
func cutByClientGoRotation(err error) bool {
	return errors.Is(err, net.ErrClosed) || strings.Contains(err.Error(), "http2: client connection force closed via ClientConn.Close")
}

// end judges a call of loop that started in phase start and returned err.
// It may succeed, unless it started after Close returned and only the pool
// can carry it (a Wrap, a poolRequest); it may fail with ErrClosed once
// Close has started, and a filesRequest also as client-go's own transport
// fails it when it rotates.
func (r *raceRound) end(start int32, what, loop string, call raceCall, err error) {
	now := r.phase.Load()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ended++
	if start == closed {
		r.afterClose[loop]++
	}
	switch {
	case err == nil && start == closed && (call == wrapCall || call == poolRequest):
		r.unexpected[what+": succeeded, sent after Close returned"]++
	case err == nil && call == wrapCall:
		r.tally.wraps++
	case err == nil:
		r.tally.requests++
		if now == running {
			r.tally.beforeClose++
			r.progress[loop]++
		}
	case now != running && errors.Is(err, ErrClosed):
		r.tally.closedErrs++
		if start == closed {
			r.tally.afterClosedErrs++
		}
	case call == filesRequest && cutByClientGoRotation(err):
		r.tally.clientGoCuts++
	default:
		r.unexpected[fmt.Sprintf("%s (%s): %v", what, [...]string{"before Close", "while Close ran", "after Close"}[now], reason(err))]++
	}
}

func (r *raceRound) count(fn func(*raceTally)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fn(&r.tally)
}

// await waits, at most 30 s, until every loop has a count in counts (what
// it waits for is what the counts count), and reports the loops that have
// none.
func (r *raceRound) await(t *testing.T, what string, counts map[string]int64) {
	const timeout = 30 * time.Second
	deadline := time.Now().Add(timeout)
	for {
		r.mu.Lock()
		var idle []string
		for loop := range r.progress { // every loop
			if counts[loop] == 0 {
				idle = append(idle, loop)
			}
		}
		r.mu.Unlock()
		if len(idle) == 0 {
			return
		}
		if time.Now().After(deadline) {
			sort.Strings(idle)
			t.Errorf("not within %v: %s, on %s", timeout, what, strings.Join(idle, "; "))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// closeUnderLoad closes the pool from two goroutines at once (Close is
// idempotent, also when raced), lets every loop go on against the closed
// pool until each has started a Wrap or request after Close returned, and
// stops them.
func (r *raceRound) closeUnderLoad(t *testing.T) {
	r.phase.Store(closing)
	var closers sync.WaitGroup
	for range 2 {
		closers.Add(1)
		go func() {
			defer closers.Done()
			if err := r.p.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		}()
	}
	closers.Wait()
	r.phase.Store(closed)
	r.await(t, "a Wrap or request sent after Close returned", r.afterClose)
	close(r.stop)
	done := make(chan struct{})
	go func() { r.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Fatalf("%d Wraps or requests have not returned 30 s after the pool closed", r.started-r.ended)
	}
}

// check asserts what the round's calls came to: none lost, none failed
// otherwise than as allowed.
func (r *raceRound) check(t *testing.T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started != r.ended {
		t.Errorf("%d Wraps and requests started, %d returned", r.started, r.ended)
	}
	if got := r.tally.wraps + r.tally.requests + r.tally.closedErrs + r.tally.clientGoCuts + sumCounts(r.unexpected); got != r.ended {
		t.Errorf("%d Wraps and requests returned, %d accounted for", r.ended, got)
	}
	for msg, n := range r.unexpected {
		t.Errorf("%dx %s", n, msg)
	}
	t.Logf("%s", &r.tally)
}

func sumCounts(m map[string]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// TestCloseWaitsForIdleExpiry: Close returns after an idle expiry in
// progress, so that nothing the pool does afterwards reaches what the
// caller handed it (a logger restored after Close). The expiry's log line
// blocks until the test lets it go; Close, started meanwhile, must not
// return before.
func TestCloseWaitsForIdleExpiry(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	inExpiry, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	logger := funcr.New(func(_, args string) {
		if strings.Contains(args, "Released an identity") {
			once.Do(func() {
				close(inExpiry)
				<-release
			})
		}
	}, funcr.Options{Verbosity: 10})
	p := New(WithLogger(logger), WithIdleTimeout(time.Millisecond))
	func() {
		rt, err := p.TransportFor(f.srv.RestConfig(f.alice))
		must(t, err)
		if code, err := getVia(rt, f.srv.URL()+"/version"); err != nil || code != http.StatusOK {
			t.Fatalf("%d %v", code, err)
		}
	}()
	for deadline := time.Now().Add(10 * time.Second); ; runtime.GC() {
		select {
		case <-inExpiry:
		case <-time.After(10 * time.Millisecond):
			if time.Now().After(deadline) {
				t.Fatal("the identity was not released after its client was collected")
			}
			continue
		}
		break
	}
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Error("Close returned while an expiry was in progress")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	<-closed
}
