package sharedtransport

import (
	"fmt"
	"net/http"
	"net/url"
	"runtime"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// heapAfterGC is the live heap once garbage collection and the cleanups it
// triggers have settled.
func heapAfterGC() uint64 {
	var ms runtime.MemStats
	for range 3 {
		runtime.GC()
		time.Sleep(5 * time.Millisecond) // cleanups run on their own goroutine
	}
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// churnConfig is identity number i: Karmada's shape, a config with a Proxy
// (uncacheable for client-go, so client-go keeps nothing of it) and a
// client certificate. The proxy is never dialed.
func churnConfig(f *fixture, i int) *rest.Config {
	cfg := f.srv.RestConfig(f.alice)
	cfg.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.%d:%d", 1+i/60000, 1024+i%60000)})
	return cfg
}

// churn builds an HTTP client over p for each of n new identities, keeping
// the clients (and so the identities) when keep is set.
func churn(t testing.TB, p *Pool, f *fixture, from, n int, keep bool) []*http.Client {
	t.Helper()
	var kept []*http.Client
	for i := from; i < from+n; i++ {
		hc, err := p.HTTPClientFor(churnConfig(f, i))
		must(t, err)
		if keep {
			kept = append(kept, hc)
		}
	}
	return kept
}

// waitReleased waits until every identity of p is released and its file
// watch stopped: an identity leaves the pool's count just before its entry
// is closed, outside the pool's lock.
func waitReleased(t testing.TB, p *Pool) {
	t.Helper()
	waitFor(t, "every identity released", func() bool {
		runtime.GC()
		return p.Stats().Identities == 0 && watchesLeft(p) == 0
	})
}

// watchesLeft is the number of identities p's file watcher still serves.
func watchesLeft(p *Pool) int {
	p.reg.mu.Lock()
	w := p.reg.watcher
	p.reg.mu.Unlock()
	if w == nil {
		return 0
	}
	return len(w.all())
}

// TestChurnMemory: 10,000 identities created, used to build clients and
// dropped: each takes at most 16 KiB of heap while live, the heap comes back
// to its starting size, and a second round leaves no more behind than the
// first (flat, not linear).
func TestChurnMemory(t *testing.T) {
	const n, again = 10000, 2000
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(0))
	// Warm up what is built once (client-go's scheme, codecs, the pool's
	// map): the baseline is a pool that has served before.
	churn(t, p, f, 0, 100, false)
	waitReleased(t, p)
	start := heapAfterGC()

	live := churn(t, p, f, 100, n, true)
	if got := p.Stats().Identities; got != n {
		t.Fatalf("%d identities live, want %d", got, n)
	}
	held := heapAfterGC()
	runtime.KeepAlive(live)
	live = nil
	waitReleased(t, p)
	after1 := heapAfterGC()

	churn(t, p, f, 100+n, again, false)
	waitReleased(t, p)
	after2 := heapAfterGC()

	perLive := (int64(held) - int64(start)) / n
	t.Logf("heap: %d KiB at the start, %d KiB with %d identities live (%d B each), %d KiB after dropping them (%+d KiB), %d KiB after %d more (%+d KiB)",
		start>>10, held>>10, n, perLive, after1>>10, (int64(after1)-int64(start))>>10, after2>>10, again, (int64(after2)-int64(after1))>>10)
	// What stays is sized by the peak, not by the churn: the pool's maps
	// keep their buckets (Go maps do not shrink: about 1 MiB for 10,000),
	// and the runtime keeps the descriptor of every goroutine that ever ran
	// (the idle timers of 10,000 identities released together: about
	// 3 MiB). Nothing of the identities themselves: a tenth of what they
	// held is far above that and far below client-go's linear growth.
	if perLive > 16<<10 {
		t.Errorf("%d bytes of heap per live identity, want at most 16 KiB", perLive)
	}
	if left, heldBytes := int64(after1)-int64(start), int64(held)-int64(start); left > heldBytes/10 {
		t.Errorf("%d KiB left after dropping identities that held %d KiB", left>>10, heldBytes>>10)
	}
	if grew := int64(after2) - int64(after1); grew > 512<<10 {
		t.Errorf("a second churn left %d KiB more: memory grows with churn", grew>>10)
	}
}

// BenchmarkIdentityChurn reports the heap held per live identity, what
// stays behind per identity once identities are dropped, and the share of
// identities the pool did not release.
//
// With Proxy set (Karmada's shape) client-go caches nothing and the pool
// releases everything: flat. client-go alone, before its transport-cache GC
// (gate ClientsAllowTLSCacheGC, client-go 1.36), keeps every transport it
// cached: linear. It caches one per distinct TLS config before the pool's
// hook runs, so for cacheable configs that part stays with the pool too;
// the pool's own part is released.
func BenchmarkIdentityChurn(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	cacheable := func(i int) *rest.Config {
		cfg := f.srv.RestConfig(f.alice)
		cfg.ServerName = fmt.Sprintf("bench-%d-%d.invalid", time.Now().UnixNano(), i) // distinct for every run
		return cfg
	}
	for _, tc := range []struct {
		name   string
		pool   bool
		config func(int) *rest.Config
	}{
		{"pool, Proxy set", true, func(i int) *rest.Config { return churnConfig(f, i) }},
		{"pool, cacheable", true, cacheable},
		{"client-go alone, cacheable", false, cacheable},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			p := newPool(b, WithIdleTimeout(0))
			start := heapAfterGC()
			b.ResetTimer()
			live := make([]*http.Client, 0, b.N)
			for i := range b.N {
				cfg := tc.config(i)
				if tc.pool {
					if err := p.Wrap(cfg); err != nil {
						b.Fatal(err)
					}
				}
				c, err := rest.HTTPClientFor(cfg)
				if err != nil {
					b.Fatal(err)
				}
				live = append(live, c)
			}
			b.StopTimer()
			held := heapAfterGC()
			runtime.KeepAlive(live)
			live = nil
			waitReleased(b, p)
			after := heapAfterGC()
			b.ReportMetric(float64(int64(held)-int64(start))/float64(b.N), "B/live-identity")
			b.ReportMetric(float64(int64(after)-int64(start))/float64(b.N), "B-left/identity")
			b.ReportMetric(float64(p.Stats().Identities)/float64(b.N), "identities-left/identity")
		})
	}
}
