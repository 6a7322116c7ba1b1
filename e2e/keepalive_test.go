package e2e

import (
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/sharedtransport/sharedtransport"
)

// TestKeepAliveOff: with keep-alive off every request opens a connection of
// its own and closes it, and session resumption leaves one full TLS
// handshake, the identity's first: 50 sequential requests on one client, then
// 20 workers x 10 requests on fresh configs, 250 connections, 1 full
// handshake and 249 resumed. The server's side counts them (tlsRelay, in
// front of kube-apiserver); the pool's Stats must agree.
func TestKeepAliveOff(t *testing.T) {
	c := cl(t)
	relay := startTLSRelay(t, c.port)
	p := sharedtransport.New(sharedtransport.WithKeepAlive(false))
	defer closePool(t, p)
	kubeconfig := c.kubeconfig("admin", false)
	cfg, err := p.BuildConfigFromFlags(relay.url(), kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cs := mustClientset(t, cfg)

	// Sequential: after each request its connection is closed, so the next
	// one has to open its own.
	const sequential = 50
	for i := range sequential {
		if err := getDefault(cs, 10*time.Second); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if open := relay.waitOpen(0, 2*time.Second); open != 0 {
			t.Errorf("request %d: %d connections still open 2 s after the response", i, open)
		}
	}
	checkOneConnectionPerRequest(t, "after the sequential requests", relay, p, sequential)

	// Concurrent, fresh configs of the same identity: all succeed, nothing
	// stays open, and their handshakes resume the identity's session.
	const workers, per = 20, 10
	errs, first := runWorkers(workers, per, func(_, _ int) error {
		cfg, err := p.BuildConfigFromFlags(relay.url(), kubeconfig)
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
	if open := relay.waitOpen(0, 5*time.Second); open != 0 {
		t.Errorf("%d connections still open after the concurrent requests", open)
	}
	checkOneConnectionPerRequest(t, "after the concurrent requests", relay, p, sequential+workers*per)
	for _, why := range relay.unreadHandshakes() {
		t.Errorf("a handshake the relay could not read: %s", why)
	}
}

// checkOneConnectionPerRequest asserts that the server accepted one
// connection per request, that only the first handshake was full, and that
// the pool counts what the server saw.
func checkOneConnectionPerRequest(t *testing.T, when string, relay *tlsRelay, p *sharedtransport.Pool, requests int) {
	t.Helper()
	accepted, peak, full, resumed := relay.counts()
	st := logStats(t, "pool "+when, p)
	t.Logf("%s: %d requests, the server accepted %d connections (at most %d open at once): %d full TLS handshakes, %d resumed",
		when, requests, accepted, peak, full, resumed)
	if accepted != requests {
		t.Errorf("%s: the server accepted %d connections for %d requests, want one per request", when, accepted, requests)
	}
	if full != 1 || resumed != requests-1 {
		t.Errorf("%s: %d full TLS handshakes and %d resumed, want 1 and %d", when, full, resumed, requests-1)
	}
	if st.Dials != uint64(accepted) || st.Handshakes != uint64(full) || st.Resumptions != uint64(resumed) {
		t.Errorf("%s: the pool counts %d dials, %d full and %d resumed handshakes; the server %d, %d and %d",
			when, st.Dials, st.Handshakes, st.Resumptions, accepted, full, resumed)
	}
}
