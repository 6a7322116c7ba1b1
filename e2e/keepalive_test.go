package e2e

import (
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/sharedtransport/sharedtransport"
)

// TestKeepAliveOff: with keep-alive off every request opens a connection of
// its own and closes it; all requests succeed.
func TestKeepAliveOff(t *testing.T) {
	c := cl(t)
	p := sharedtransport.New(sharedtransport.WithKeepAlive(false))
	defer closePool(t, p)
	cfg, err := p.BuildConfigFromFlags("", c.kubeconfig("admin", false))
	if err != nil {
		t.Fatal(err)
	}
	cs := mustClientset(t, cfg)
	w := watchConns(t, c.port, 2*time.Millisecond)

	// Sequential: after each request its connection is closed, so the next
	// one has to open its own.
	const sequential = 50
	lingering := 0
	start := time.Now()
	for i := 0; i < sequential; i++ {
		if err := getDefault(cs, 10*time.Second); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if open := w.waitOpen(0, 2*time.Second); open != 0 {
			lingering++
			t.Errorf("request %d: %d connections still open 2s after the response", i, open)
		}
	}
	seqElapsed := time.Since(start)
	distinct, _ := w.Seen()
	statsSeq := logStats(t, "pool after sequential", p)
	t.Logf("%d sequential requests in %v: %d distinct connections sampled (a lower bound), %d lingering",
		sequential, seqElapsed.Round(time.Millisecond), distinct, lingering)

	// Concurrent, fresh configs: all succeed, nothing stays open.
	const workers, per = 20, 10
	errs, first := runWorkers(workers, per, func(_, _ int) error {
		cfg, err := p.BuildConfigFromFlags("", c.kubeconfig("admin", false))
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return err
		}
		return getDefault(cs, 20*time.Second)
	})
	if errs > 0 {
		t.Errorf("%d of %d concurrent requests failed, first: %v", errs, workers*per, first)
	}
	if open := w.waitOpen(0, 5*time.Second); open != 0 {
		t.Errorf("%d connections still open after the concurrent requests", open)
	}
	_, peak := w.Seen()
	stats := logStats(t, "pool after concurrent", p)
	t.Logf("%d concurrent requests: peak %d connections open at once", workers*per, peak)

	total := uint64(sequential + workers*per)
	if stats.Dials != 0 && stats.Dials != total {
		t.Errorf("Stats.Dials = %d for %d requests with keep-alive off, want one connection per request", stats.Dials, total)
	}
	if statsSeq.Dials != 0 && statsSeq.Dials != sequential {
		t.Errorf("Stats.Dials = %d after %d sequential requests, want %d", statsSeq.Dials, sequential, sequential)
	}
	if stats.Handshakes+stats.Resumptions > 0 {
		t.Logf("TLS: %d full handshakes, %d resumed (%.0f%% resumed)", stats.Handshakes, stats.Resumptions,
			100*float64(stats.Resumptions)/float64(stats.Handshakes+stats.Resumptions))
	}
}
