package sharedtransport

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestSessionResumption: with keep-alive off, a connection per request, and
// every handshake a resumption but at most one per worker and identity; the
// server sees the right client certificate on every resumed connection; two
// identities never resume each other's sessions; the pool counts what the
// server saw.
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
				must(t, p.Wrap(cfg))
				cs, err := kubernetes.NewForConfig(cfg)
				must(t, err)
				clients[name] = cs
			}
			n, workers := 1000, 8
			if testing.Short() {
				n = 160 // far more requests than the full handshakes allowed
			}
			requireNoErrors(t, runClients(workers, n/workers, func(w, i int) error {
				name := []string{"alice", "bob"}[(w+i)%2]
				_, err := clients[name].CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
				return err
			}))
			st := f.srv.Stats()
			t.Logf("%s, keep-alive off: %d requests, %d connections, %d full handshakes, %d resumed; pool %+v",
				tls.VersionName(version), n, st.Accepted, st.FullHandshakes, st.ResumedHandshakes, p.Stats())
			if st.Accepted != uint64(n) {
				t.Errorf("keep-alive off: %d connections for %d requests, want one each", st.Accepted, n)
			}
			// A handful of full handshakes: at least one per identity, and
			// one for each worker whose request found its identity's cache
			// still empty; once a handshake of an identity has ended, the
			// cache holds its session.
			if max := workers * len(clients); st.FullHandshakes > uint64(max) {
				t.Errorf("%d full handshakes for %d requests, want at most %d (one per worker and identity): sessions are not resumed", st.FullHandshakes, n, max)
			}
			if wrongCert != 0 {
				t.Errorf("the server saw the wrong client certificate on %d requests: a session was resumed across identities", wrongCert)
			}
			if ps := p.Stats(); ps.Dials != st.Accepted || ps.Handshakes != st.FullHandshakes || ps.Resumptions != st.ResumedHandshakes {
				t.Errorf("pool counted %d dials, %d full handshakes and %d resumptions; the server %d, %d and %d",
					ps.Dials, ps.Handshakes, ps.Resumptions, st.Accepted, st.FullHandshakes, st.ResumedHandshakes)
			}
		})
	}

	t.Run("resumption off", func(t *testing.T) {
		f := newFixture(t, testserver.Options{})
		p := newPool(t, WithKeepAlive(false), WithSessionResumption(false))
		cfg := f.srv.RestConfig(f.alice)
		must(t, p.Wrap(cfg))
		for range 10 {
			must(t, listNodes(context.Background(), cfg))
		}
		if st := f.srv.Stats(); st.ResumedHandshakes != 0 || st.FullHandshakes != 10 {
			t.Errorf("resumption off: %d full, %d resumed handshakes, want 10 and 0", st.FullHandshakes, st.ResumedHandshakes)
		}
	})
}

// TestRotationClosesOldConnsWhenIdle: a connection busy at the moment of a
// rotation closes as soon as its request ends, not at the drain timeout or
// the idle timeout.
func TestRotationClosesOldConnsWhenIdle(t *testing.T) {
	for _, http1 := range []bool{false, true} {
		t.Run(fmt.Sprintf("http1=%v", http1), func(t *testing.T) {
			hold := newRequestHold(t)
			f := newFixture(t, testserver.Options{OnRequest: hold.onRequest, DisableHTTP2: http1})
			dave, err := f.ca.IssueClient("dave")
			must(t, err)
			p := newPool(t, WithPollInterval(0), WithDrainTimeout(time.Minute))
			d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
			client := httpClient(t, p, d.config(f.srv.URL()))
			if _, err := getUA(context.Background(), client, f.srv.URL(), "warm-up"); err != nil {
				t.Fatal(err)
			}
			slow := make(chan error, 1)
			go func() {
				_, err := getUA(context.Background(), client, f.srv.URL(), "hold")
				slow <- err
			}()
			waitFor(t, "the slow request reaches the server", func() bool { return hold.held.Load() == 1 })
			d.write(t, dave, f.ca.CertPEM())
			waitFor(t, "rotation", func() bool { return p.Stats().Rotations == 1 })
			if _, err := getUA(context.Background(), client, f.srv.URL(), "after"); err != nil {
				t.Fatal(err)
			}
			hold.releaseAll()
			must(t, <-slow)
			done := time.Now()
			waitFor(t, "the old generation's connection closed once idle", func() bool { return f.srv.Stats().Open == 1 })
			t.Logf("the old connection closed %v after its request ended", time.Since(done).Round(time.Millisecond))
		})
	}
}

// TestHTTP1OnlyOneConnection: an identity that talks HTTP/1.1, because the
// server has no HTTP/2 or because the config asks for http/1.1 only, reuses
// its first connection for sequential requests.
func TestHTTP1OnlyOneConnection(t *testing.T) {
	for _, tc := range []struct {
		name       string
		server     testserver.Options
		nextProtos []string
	}{
		{"server without HTTP/2", testserver.Options{DisableHTTP2: true}, nil},
		{"ALPN http/1.1", testserver.Options{}, []string{"http/1.1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.server)
			p := newPool(t)
			cfg := f.srv.RestConfig(f.alice)
			cfg.NextProtos = tc.nextProtos
			client := httpClient(t, p, cfg)
			for range 20 {
				proto, err := getUA(context.Background(), client, f.srv.URL(), "sequential")
				if err != nil || proto != "HTTP/1.1" {
					t.Fatalf("%s %v", proto, err)
				}
			}
			if st := f.srv.Stats(); st.Accepted != 1 {
				t.Errorf("20 sequential HTTP/1.1 requests: the server accepted %d connections, want 1", st.Accepted)
			}
		})
	}
}

// TestCloseIdleConnectionsFor: utilnet.CloseIdleConnectionsFor on a wrapped
// client closes the idle connections of every transport its requests went
// over: both of the pool's, and client-go's for hosts the pool does not
// serve for that client.
func TestCloseIdleConnectionsFor(t *testing.T) {
	t.Run("HTTP/1.1 server", func(t *testing.T) {
		f := newFixture(t, testserver.Options{DisableHTTP2: true, Latency: 20 * time.Millisecond})
		p := newPool(t)
		client := httpClient(t, p, f.srv.RestConfig(f.alice))
		if _, err := concurrentGets(context.Background(), client, f.srv.URL(), "concurrent", 10); err != nil {
			t.Fatal(err)
		}
		open := f.srv.Stats().Open
		if open == 0 {
			t.Fatal("no connection stayed open after 10 concurrent requests: nothing to close")
		}
		utilnet.CloseIdleConnectionsFor(client.Transport)
		waitFor(t, "every idle connection closed", func() bool { return f.srv.Stats().Open == 0 })
		t.Logf("%d idle connections closed", open)
	})
	t.Run("other host", func(t *testing.T) {
		f := newFixture(t, testserver.Options{})
		other := f.startServer(t, testserver.Options{})
		proxy := newConnectProxy(t)
		p := newPool(t)
		cfg := f.srv.RestConfig(f.alice)
		cfg.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: proxy.Addr()})
		must(t, p.Wrap(cfg))
		moved := rest.CopyConfig(cfg)
		moved.Host = other.URL()
		client, err := rest.HTTPClientFor(moved)
		must(t, err)
		if _, err := getUA(context.Background(), client, other.URL(), "other host"); err != nil {
			t.Fatal(err)
		}
		if other.Stats().Open != 1 {
			t.Fatalf("the other host has %d connections open", other.Stats().Open)
		}
		utilnet.CloseIdleConnectionsFor(client.Transport)
		waitFor(t, "the other host's idle connection closed", func() bool { return other.Stats().Open == 0 })
	})
}

func TestKeepAliveOff(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithKeepAlive(false))
	ctx := context.Background()
	const n = 10
	for range n {
		cfg := f.srv.RestConfig(f.alice)
		must(t, p.Wrap(cfg))
		must(t, listNodes(ctx, cfg))
	}
	st := f.srv.Stats()
	if st.Accepted != n {
		t.Errorf("keep-alive off: %d requests, %d connections, want one each", n, st.Accepted)
	}
	// The server sees each connection closed a moment after the response
	// the client read: the last ones may still be open here.
	waitFor(t, "keep-alive off leaves no connection open", func() bool { return f.srv.Stats().Open == 0 })

	// client-go's own transport for an unrelated config keeps its connection.
	f.srv.ResetStats()
	plain := f.srv.RestConfig(f.bob)
	cs, err := kubernetes.NewForConfig(plain)
	must(t, err)
	for range n {
		if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if st := f.srv.Stats(); st.Accepted != 1 {
		t.Errorf("client-go's own transport opened %d connections for %d requests, want 1: the pool touched it", st.Accepted, n)
	}
	f.srv.CloseClientConnections()
}
