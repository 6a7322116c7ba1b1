package karmada

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/chart"
)

// The seed's load: 100 clients, 20 requests each, through the front.
const (
	seedClients  = 100
	seedRequests = 20
)

// serveFront serves f on a local HTTP server.
func serveFront(t testing.TB, f *front) string {
	t.Helper()
	s := httptest.NewServer(f)
	t.Cleanup(s.Close)
	return s.URL
}

// loadResult is what a load through the front saw.
type loadResult struct {
	ok, failed, wrongUser int64
	firstErr              atomic.Value
	elapsed               time.Duration
	cpu                   time.Duration // the test process's: front, proxy and load together
}

// whoAmI asks the member, through the front, which user it saw, as user.
func whoAmI(ctx context.Context, hc *http.Client, frontURL, user string) (string, error) {
	body := `{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, frontURL+"/apis/authentication.k8s.io/v1/selfsubjectreviews", bytes.NewBufferString(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Remote-User", user)
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusCreated {
		return "", fmt.Errorf("status %s: %.300s", resp.Status, b)
	}
	var ssr authenticationv1.SelfSubjectReview
	if err := json.Unmarshal(b, &ssr); err != nil {
		return "", err
	}
	return ssr.Status.UserInfo.Username, nil
}

// load runs clients x requests through the front, each request as a user of
// its own, and checks the user the member saw.
func load(t testing.TB, frontURL string, clients, requests int) *loadResult {
	t.Helper()
	hc := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	defer hc.CloseIdleConnections()
	r := &loadResult{}
	cpu0 := processCPU()
	start := time.Now()
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range requests {
				want := fmt.Sprintf("user-%d-%d", c, i)
				got, err := whoAmI(context.Background(), hc, frontURL, want)
				switch {
				case err != nil:
					atomic.AddInt64(&r.failed, 1)
					r.firstErr.CompareAndSwap(nil, err.Error())
				case got != want:
					atomic.AddInt64(&r.wrongUser, 1)
					r.firstErr.CompareAndSwap(nil, fmt.Sprintf("the member saw %q for %q", got, want))
				default:
					atomic.AddInt64(&r.ok, 1)
				}
			}
		}()
	}
	wg.Wait()
	r.elapsed = time.Since(start)
	r.cpu = processCPU() - cpu0
	return r
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// watch is a watch of config maps in default through the front.
type watch struct {
	events chan string // names of the config maps added
	cancel context.CancelFunc
	done   chan error
}

func startWatch(t testing.TB, frontURL string) *watch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, frontURL+"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion=0", nil)
	req.Header.Set("X-Remote-User", "watcher")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		cancel()
		t.Fatalf("watch: %s: %s", resp.Status, b)
	}
	w := &watch{events: make(chan string, 100), cancel: cancel, done: make(chan error, 1)}
	go func() {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var ev struct {
				Type   string
				Object corev1.ConfigMap
			}
			if json.Unmarshal(sc.Bytes(), &ev) == nil && ev.Type == "ADDED" {
				select {
				case w.events <- ev.Object.Name:
				default: // a config map nobody waits for
				}
			}
		}
		w.done <- sc.Err()
	}()
	t.Cleanup(func() { cancel(); <-w.done })
	return w
}

// wantEvent creates a config map named name and waits for the watch to
// report it.
func (w *watch) wantEvent(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case got := <-w.events:
			if got == name {
				return
			}
		case err := <-w.done:
			t.Fatalf("the watch ended before %s was added: %v", name, err)
		case <-ctx.Done():
			t.Fatalf("the watch did not report %s within 30s", name)
		}
	}
}

// row is one mode's line of the measured table.
type row struct {
	mode                 mode
	tunnels, refused     uint64
	openAtEnd            int
	ok, lost, wrong      int64
	handshakes, resumed  uint64
	reqPerSec, cpuPerReq float64
	tunnelsOpen          []chart.Point // over the load, where sampled
}

// TestSeedLoad is the seed's load through Karmada's aggregated path
// (Location), counted at the proxy: against Karmada as is, with keep-alive
// off and on, one tunnel per request; against patched Karmada
// (karmada/hack/test-patched.sh), on the pool, about as many tunnels as
// Go's transport as Karmada builds it opens when one is shared by every
// request (sharedOnce, the control: medians of three rounds, interleaved,
// as both dial as net/http dials), and a watch through the front that
// outlives the load. Nothing refused or lost, every request seen as its own
// user.
func TestSeedLoad(t *testing.T) {
	// Karmada as is builds a transport per request; patched, its own
	// Location hands out the pool's.
	modes, rounds := []mode{asIs, keepAliveOn}, 1
	if patched {
		modes, rounds = []mode{sharedOnce, pooled}, 3
	}
	var rows []row
	tunnels := map[mode][]uint64{}
	for range rounds {
		for _, m := range modes {
			r := runSeedMode(t, m)
			rows = append(rows, r)
			tunnels[m] = append(tunnels[m], r.tunnels)
			t.Logf("%s: %+v", m, r)
		}
	}
	t.Logf("\n| mode | tunnels (= connections to the member) | open after the load | full handshakes | resumed | refused | lost | req/s | test-process CPU per request |\n|---|---|---|---|---|---|---|---|---|")
	for _, r := range rows {
		t.Logf("| %s | %d | %d | %d | %d | %d | %d | %.0f | %.2f ms |", r.mode, r.tunnels, r.openAtEnd, r.handshakes, r.resumed, r.refused, r.lost+r.wrong, r.reqPerSec, r.cpuPerReq)
	}
	if patched {
		checkTunnelsAsShared(t, "Karmada + TLSTransport", tunnels[pooled], tunnels[sharedOnce])
	}
}

// checkTunnelsAsShared fails t when the median of got, the tunnels of
// rounds through the pool, is more than twice the most of control, those of
// Go's transport as Karmada builds it, shared: both dial as net/http dials,
// and their counts vary from round to round.
func checkTunnelsAsShared(t *testing.T, what string, got, control []uint64) {
	t.Helper()
	median := func(v []uint64) uint64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	t.Logf("%s: tunnels %v, median %d; Karmada's transport, shared: %v", what, got, median(got), control)
	if median(got) > 2*slices.Max(control) {
		t.Errorf("%s: a median of %d tunnels, more than twice the most of Karmada's transport, shared (%v)", what, median(got), control)
	}
}

func runSeedMode(t *testing.T, m mode) row {
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	f := &front{mode: m, secrets: sec, cluster: cl}
	if m == pooled {
		f.pool = sharedtransport.New()
	}
	if f.pool != nil {
		t.Cleanup(clusterTransports(f.pool)) // after the watch's
	}
	url := serveFront(t, f)
	t.Cleanup(func() { // after the watch's
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.shared != nil {
			f.shared.(*http.Transport).CloseIdleConnections()
		}
	})
	var w *watch
	if m == pooled || m == sharedOnce {
		w = startWatch(t, url)
	}
	res := load(t, url, seedClients, seedRequests)
	st := proxy.Stats()
	total := int64(seedClients * seedRequests)
	r := row{mode: m, tunnels: st.Tunnels, refused: st.Rejected, openAtEnd: st.Open, ok: res.ok, lost: res.failed, wrong: res.wrongUser,
		reqPerSec: float64(total) / res.elapsed.Seconds(), cpuPerReq: float64(res.cpu.Milliseconds()) / float64(total)}
	// Karmada's TLS configurations have no session cache: every tunnel
	// carries one full handshake. The pool counts its own.
	r.handshakes = st.Tunnels
	if f.pool != nil {
		ps := f.pool.Stats()
		r.handshakes, r.resumed = ps.Handshakes, ps.Resumptions
	}
	if res.ok != total || st.Rejected != 0 {
		t.Errorf("%s: %d of %d requests right, %d failed, %d seen as another user, %d tunnels refused; first: %v",
			m, res.ok, total, res.failed, res.wrongUser, st.Rejected, res.firstErr.Load())
	}
	if m == asIs && st.Tunnels != uint64(total) {
		t.Errorf("%s: %d tunnels for %d requests, want one per request", m, st.Tunnels, total)
	}
	if w != nil {
		w.wantEvent(t, fmt.Sprintf("after-the-load-%d-%d", m, time.Now().UnixNano())) // unique: the test may run with -count above 1
		if n := proxy.Stats().Tunnels; n > st.Tunnels {
			t.Errorf("%s: the watch's event came over a new tunnel (%d, %d after the load)", m, n, st.Tunnels)
		}
	}
	return r
}
