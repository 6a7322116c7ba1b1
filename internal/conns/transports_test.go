package conns

import (
	"crypto/tls"
	"runtime"
	"testing"
	"time"
	"weak"
)

// TestRotationsKeepNothing: a Transports retired and drained is not kept
// reachable by the ones that took over after it, however many rotations
// follow; the current one still reaches the ones draining.
func TestRotationsKeepNothing(t *testing.T) {
	cfg := Config{TLS: &tls.Config{}, KeepAlive: true}
	cur := NewTransports(cfg, nil)
	first := weak.Make(cur)
	for range 5 {
		next := NewTransports(cfg, cur)
		cur.Retire(0)
		for deadline := time.Now().Add(10 * time.Second); !cur.isClosed(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("a Transports retired with no drain did not close")
			}
		}
		cur = next
	}
	draining := NewTransports(cfg, cur)
	cur.Retire(time.Hour)
	defer draining.Close(nil)
	if got := draining.olderOpen(); len(got) != 1 || got[0] != cur {
		t.Fatalf("the current Transports reaches %d draining ones, want the one it took over from", len(got))
	}
	deadline := time.Now().Add(10 * time.Second)
	for first.Value() != nil {
		if time.Now().After(deadline) {
			t.Fatal("the first Transports is still reachable after 6 rotations, its drain long over")
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

// TestNoTimerAfterClose: a request that ends on a retired Transports after
// Close sets no timer that would outlive it.
func TestNoTimerAfterClose(t *testing.T) {
	tr := NewTransports(Config{TLS: &tls.Config{}, KeepAlive: true}, nil)
	tr.Retire(time.Hour)
	tr.Close(nil)
	tr.requestEnded()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.idleRecheck != nil {
		t.Error("a request that ended after Close set the idle recheck timer")
	}
}
