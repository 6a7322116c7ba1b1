package sharedtransport

import (
	"context"
	"crypto/tls"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestSessionResumption: with keep-alive off, a connection per request, and
// almost every handshake a resumption; the server sees the right client
// certificate on every resumed connection; two identities never resume each
// other's sessions.
func TestSessionResumption(t *testing.T) {
	for _, version := range []uint16{tls.VersionTLS12, tls.VersionTLS13} {
		t.Run(tls.VersionName(version), func(t *testing.T) {
			var mu sync.Mutex
			wrongCert, resumed := 0, 0
			f := newFixture(t, testserver.Options{MinTLSVersion: version, MaxTLSVersion: version, OnRequest: func(ri testserver.RequestInfo) {
				mu.Lock()
				defer mu.Unlock()
				if ri.Resumed {
					resumed++
				}
				if ri.CertCN != ri.UserAgent {
					wrongCert++
				}
			}})
			p := newPool(t, WithKeepAlive(false))
			clients := map[string]kubernetes.Interface{}
			for name, kp := range map[string]*testserver.KeyPair{"alice": f.alice, "bob": f.bob} {
				cfg := f.srv.RestConfig(kp)
				cfg.UserAgent = name // the server checks the certificate against it
				cfg.QPS = -1         // no client-side rate limit: the load is the point
				if err := p.Wrap(cfg); err != nil {
					t.Fatal(err)
				}
				cs, err := kubernetes.NewForConfig(cfg)
				if err != nil {
					t.Fatal(err)
				}
				clients[name] = cs
			}
			const n = 1000
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			for w := range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range n / 8 {
						name := []string{"alice", "bob"}[(w+i)%2]
						if _, err := clients[name].CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			st := f.srv.Stats()
			t.Logf("%s, keep-alive off: %d requests, %d connections, %d full handshakes, %d resumed; pool %+v",
				tls.VersionName(version), n, st.Accepted, st.FullHandshakes, st.ResumedHandshakes, p.Stats())
			if st.Accepted < n {
				t.Errorf("keep-alive off: %d connections for %d requests", st.Accepted, n)
			}
			// A handful of full handshakes: at least one per identity, a few
			// more where concurrent first requests found an empty cache.
			if st.FullHandshakes > 20 {
				t.Errorf("%d full handshakes for %d requests: sessions are not resumed", st.FullHandshakes, n)
			}
			if wrongCert != 0 {
				t.Errorf("the server saw the wrong client certificate on %d requests: a session was resumed across identities", wrongCert)
			}
			if ps := p.Stats(); ps.Resumptions < n-20 || ps.Handshakes > 20 {
				t.Errorf("pool counted %d full handshakes and %d resumptions", ps.Handshakes, ps.Resumptions)
			}
		})
	}

	t.Run("resumption off", func(t *testing.T) {
		f := newFixture(t, testserver.Options{})
		p := newPool(t, WithKeepAlive(false), WithSessionResumption(false))
		cfg := f.srv.RestConfig(f.alice)
		if err := p.Wrap(cfg); err != nil {
			t.Fatal(err)
		}
		for range 10 {
			if err := listNodes(context.Background(), cfg); err != nil {
				t.Fatal(err)
			}
		}
		if st := f.srv.Stats(); st.ResumedHandshakes != 0 || st.FullHandshakes != 10 {
			t.Errorf("resumption off: %d full, %d resumed handshakes, want 10 and 0", st.FullHandshakes, st.ResumedHandshakes)
		}
	})
}

// TestColdStartBurst: a burst of first requests through one new client waits
// for the first connection instead of dialing one each.
func TestColdStartBurst(t *testing.T) {
	for _, n := range []int{100, 300} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			f := newFixture(t, testserver.Options{})
			p := newPool(t)
			burst(t, wrappedClient(t, p, f.srv.RestConfig(f.alice)), n)
			st := f.srv.Stats()
			// The physical minimum is one connection per 100 concurrent
			// streams, the server's limit. Beyond the first 100, Go may
			// finish a dial whose request was served meanwhile; the server
			// sees it closed as surplus at once, so what it holds open is
			// the minimum.
			limit := (n + 99) / 100
			t.Logf("burst of %d: server accepted %d connections (minimum %d), peak open %d", n, st.Accepted, limit, st.PeakOpen)
			// Under the race detector a dial can outlast the request that
			// started it by a connection's worth of time: one over.
			if st.PeakOpen > limit+1 || (n <= 100 && st.Accepted != 1) {
				t.Errorf("burst of %d first requests: %d connections accepted, %d open at once; want at most %d open", n, st.Accepted, st.PeakOpen, limit+1)
			}
		})
	}
}

// TestConnectionCap: a cap of 1 with 500 concurrent requests against a
// server allowing 100 streams per connection: one connection, every request
// succeeds, the ones beyond the stream limit queue.
func TestConnectionCap(t *testing.T) {
	f := newFixture(t, testserver.Options{Latency: 20 * time.Millisecond})
	p := newPool(t, WithMaxConnsPerHost(1))
	const n = 500
	burst(t, wrappedClient(t, p, f.srv.RestConfig(f.alice)), n)
	st := f.srv.Stats()
	t.Logf("cap 1, %d concurrent requests: server accepted %d connections, peak open %d", n, st.Accepted, st.PeakOpen)
	if st.Accepted != 1 {
		t.Errorf("cap 1: the server accepted %d connections", st.Accepted)
	}
}

// wrappedClient wraps cfg with p and returns a clientset without client-side
// rate limiting: the load is the point.
func wrappedClient(t testing.TB, p *Pool, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	cfg.QPS = -1
	if err := p.Wrap(cfg); err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// burst sends n node lists through cs all at once and fails t if any fails.
func burst(t testing.TB, cs kubernetes.Interface, n int) {
	t.Helper()
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
