package sharedtransport

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// BenchmarkRoundTrip: what the pool adds per request. "http.Transport" is
// the baseline (a transport built as client-go builds one), "pool" the same
// request through the pool's round tripper. The connection layer alone is
// measured in internal/conns (BenchmarkRoundTripNoopBase).
func BenchmarkRoundTrip(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	req := func() *http.Request {
		r, err := http.NewRequest(http.MethodGet, f.srv.URL()+"/version", nil)
		if err != nil {
			b.Fatal(err)
		}
		return r
	}
	send := func(b *testing.B, rt http.RoundTripper) {
		r := req()
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			resp, err := rt.RoundTrip(r)
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}

	cfg := f.srv.RestConfig(f.alice)
	b.Run("http.Transport", func(b *testing.B) {
		tlsConfig, err := rest.TLSConfigFor(cfg)
		if err != nil {
			b.Fatal(err)
		}
		t := utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: tlsConfig})
		defer t.CloseIdleConnections()
		send(b, t)
	})
	b.Run("pool", func(b *testing.B) {
		p := newPool(b)
		l := benchLease(b, p, rest.CopyConfig(cfg))
		send(b, l)
	})
	// client-go's whole stack for a config, alone and over the pool (the
	// hook's per-client layer included).
	b.Run("client-go stack", func(b *testing.B) {
		rt, err := rest.TransportFor(rest.CopyConfig(cfg))
		if err != nil {
			b.Fatal(err)
		}
		send(b, rt)
	})
	b.Run("client-go stack over the pool", func(b *testing.B) {
		wrapped := rest.CopyConfig(cfg)
		if err := newPool(b).Wrap(wrapped); err != nil {
			b.Fatal(err)
		}
		rt, err := rest.TransportFor(wrapped)
		if err != nil {
			b.Fatal(err)
		}
		send(b, rt)
		runtime.KeepAlive(wrapped)
	})
	// A config with a Proxy, asked per request where the request goes;
	// over the pool through TransportFor (Wrap passes it through).
	for _, pooled := range []bool{false, true} {
		name := "client-go stack, Proxy"
		if pooled {
			name += ", over the pool"
		}
		b.Run(name, func(b *testing.B) {
			c := rest.CopyConfig(cfg)
			c.Proxy = http.ProxyURL(nil)
			transportFor := rest.TransportFor
			if pooled {
				transportFor = transportForFn(newPool(b))
			}
			rt, err := transportFor(c)
			if err != nil {
				b.Fatal(err)
			}
			send(b, rt)
			runtime.KeepAlive(c)
		})
	}
}

// benchLease wraps cfg and returns the round tripper the hook installs.
func benchLease(b *testing.B, p *Pool, cfg *rest.Config) *lease {
	if err := p.Wrap(cfg); err != nil {
		b.Fatal(err)
	}
	rt, err := rest.TransportFor(cfg)
	if err != nil {
		b.Fatal(err)
	}
	for {
		switch t := rt.(type) {
		case *lease:
			return t
		case *clientTransport:
			return t.lease
		case utilnet.RoundTripperWrapper:
			rt = t.WrappedRoundTripper()
		default:
			b.Fatalf("no lease under %T", rt)
		}
	}
}

// benchConfig is a config of one identity, built afresh for every operation.
type benchConfig struct {
	name string
	cfg  func() *rest.Config
}

// benchConfigs are inline material, with and without a wrapper (declared
// to the pool), file material, and file material with a Proxy (which
// client-go cannot cache). Each carries a bearer token, as a member config
// does.
func benchConfigs(b *testing.B, f *fixture) []benchConfig {
	paths := f.kubeconfig(b, "alice", f.alice)
	return []benchConfig{
		{"inline", func() *rest.Config {
			c := f.srv.RestConfig(f.alice)
			c.BearerToken = "token"
			return c
		}},
		{"inline+wrapper", func() *rest.Config {
			c := f.srv.RestConfig(f.alice)
			c.BearerToken = "token"
			c.Wrap(func(rt http.RoundTripper) http.RoundTripper { return rt })
			return c
		}},
		{"files", func() *rest.Config {
			c := &rest.Config{Host: f.srv.URL(), BearerToken: "token"}
			c.CAFile, c.CertFile, c.KeyFile = paths.CA, paths.Cert, paths.Key
			return c
		}},
		{"files+proxy", func() *rest.Config {
			c := &rest.Config{Host: f.srv.URL(), BearerToken: "token", Proxy: nilProxy}
			c.CAFile, c.CertFile, c.KeyFile = paths.CA, paths.Cert, paths.Key
			return c
		}},
	}
}

// BenchmarkWrap: the cost of Wrap per config, on a hit (the identity
// exists), for inline material (with a declared wrapper too) and file
// material, and for a config with a Proxy, which Wrap passes through.
func BenchmarkWrap(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	for _, tc := range benchConfigs(b, f) {
		b.Run(tc.name, func(b *testing.B) {
			p := newPool(b)
			b.ReportAllocs()
			for b.Loop() {
				if err := p.Wrap(tc.cfg(), WithPerRequestWrappers()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkTransportFor: a round tripper per config, the identity existing,
// side by side in one run: client-go alone (rest.TransportFor; a cache hit
// for inline and file material, a new transport with a Proxy), Wrap and then
// rest.TransportFor (client-go builds its transport before the hook), and
// the pool's TransportFor.
func BenchmarkTransportFor(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	for _, tc := range benchConfigs(b, f) {
		for _, way := range []struct {
			name string
			rt   func(p *Pool, cfg *rest.Config) (http.RoundTripper, error)
		}{
			{"rest.TransportFor", func(_ *Pool, cfg *rest.Config) (http.RoundTripper, error) { return rest.TransportFor(cfg) }},
			// The pool's entry points are told that the wrapper of
			// inline+wrapper leaves connections alone.
			{"Wrap+rest.TransportFor", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) {
				if err := p.Wrap(cfg, WithPerRequestWrappers()); err != nil {
					return nil, err
				}
				return rest.TransportFor(cfg)
			}},
			{"pool.TransportFor", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) {
				return p.TransportFor(cfg, WithPerRequestWrappers())
			}},
		} {
			b.Run(tc.name+"/"+way.name, func(b *testing.B) {
				p := newPool(b)
				if _, err := way.rt(p, tc.cfg()); err != nil {
					b.Fatal(err)
				}
				b.ReportAllocs()
				for b.Loop() {
					if _, err := way.rt(p, tc.cfg()); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkSeedLoad is the seed's load at small scale, side by side in one
// run: every operation is one request through a fresh rest.Config (from a
// kubeconfig file, Proxy set as in Karmada's member configs) and a fresh
// clientset (over the pool from HTTPClientFor), from parallel goroutines.
// Reported beside time: connections the server accepted and full TLS
// handshakes, per request.
func BenchmarkSeedLoad(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	kubeconfig := f.kubeconfig(b, "alice", f.alice).Kubeconfig
	newConfig := func() *rest.Config {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			b.Fatal(err)
		}
		cfg.Proxy = nilProxy
		return cfg
	}
	type clientsetFor func(*rest.Config) (kubernetes.Interface, error)
	pooled := func(p *Pool) clientsetFor {
		return func(cfg *rest.Config) (kubernetes.Interface, error) { return pooledClientset(p, cfg) }
	}
	for _, mode := range []struct {
		name    string
		prepare func(b *testing.B) clientsetFor
	}{
		{"client-go", func(*testing.B) clientsetFor {
			return func(cfg *rest.Config) (kubernetes.Interface, error) { return kubernetes.NewForConfig(cfg) }
		}},
		{"client-go keep-alive off (Karmada)", func(*testing.B) clientsetFor {
			return func(cfg *rest.Config) (kubernetes.Interface, error) {
				tlsConfig, err := rest.TLSConfigFor(cfg)
				if err != nil {
					return nil, err
				}
				cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper {
					return utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: tlsConfig, DisableKeepAlives: true})
				}
				return kubernetes.NewForConfig(cfg)
			}
		}},
		{"pool", func(b *testing.B) clientsetFor { return pooled(newPool(b)) }},
		{"pool keep-alive off", func(b *testing.B) clientsetFor { return pooled(newPool(b, WithKeepAlive(false))) }},
		{"pool keep-alive off, no resumption", func(b *testing.B) clientsetFor {
			return pooled(newPool(b, WithKeepAlive(false), WithSessionResumption(false)))
		}},
	} {
		b.Run(strings.ReplaceAll(mode.name, " ", "_"), func(b *testing.B) {
			prepare := mode.prepare(b)
			f.srv.CloseClientConnections()
			f.srv.ResetStats()
			var failed atomic.Int64
			b.SetParallelism(4)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					cs, err := prepare(newConfig())
					if err != nil {
						b.Error(err)
						return
					}
					if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
						failed.Add(1)
					}
				}
			})
			b.StopTimer()
			st := f.srv.Stats()
			b.ReportMetric(float64(st.Accepted)/float64(b.N), "conns/op")
			b.ReportMetric(float64(st.FullHandshakes)/float64(b.N), "handshakes/op")
			if failed.Load() > 0 {
				b.Errorf("%d requests failed", failed.Load())
			}
			f.srv.CloseClientConnections()
		})
	}
}

// BenchmarkRotationLatency measures, for each way files really change, the
// time from the write completing to the first request the server sees with
// the new certificate, over 20 rotations (b.N is ignored: run it with
// -benchtime 1x). The "poll only" row turns file events off. The "busy" rows
// rename files over (as "temp file renamed over") in a directory that never
// goes quiet: a file beside the certificate appended to every 30 ms, or the
// CA file rewritten unchanged every 30 ms.
func BenchmarkRotationLatency(b *testing.B) {
	rec := &cnRecorder{}
	f := newFixture(b, testserver.Options{OnRequest: rec.record})
	const rotations = 20
	var pairs []*testserver.KeyPair
	for i := range rotations {
		kp, err := f.ca.IssueClient(fmt.Sprintf("rotation-%d", i))
		if err != nil {
			b.Fatal(err)
		}
		pairs = append(pairs, kp)
	}
	for _, kind := range []string{inPlace, renameOver, secretVolume, deleteCreate, certThenKey, "poll only", busyBeside, busyCA} {
		b.Run(strings.ReplaceAll(kind, " ", "_"), func(b *testing.B) {
			opts := []Option{WithPollInterval(0), WithDrainTimeout(time.Second)}
			layout := kind
			switch kind {
			case "poll only":
				layout = secretVolume
				opts = []Option{WithPollInterval(time.Second), func(o *options) { o.disableNotify = true }}
			case busyBeside, busyCA:
				layout = renameOver
			}
			p := newPool(b, opts...)
			d := newCertDir(b, layout, f.alice, f.ca.CertPEM())
			if kind == busyBeside || kind == busyCA {
				stopNoise := busy(b, d, kind, f.ca.CertPEM(), 30*time.Millisecond)
				defer stopNoise()
			}
			cfg := d.config(f.srv.URL())
			cfg.QPS = -1
			if err := p.Wrap(cfg); err != nil {
				b.Fatal(err)
			}
			cs, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				b.Fatal(err)
			}
			stop := make(chan struct{})
			_, fails, done := requestLoop(cs, 100, stop)
			var lat []time.Duration
			b.ResetTimer()
			for _, kp := range pairs {
				d.write(b, kp, f.ca.CertPEM())
				written := time.Now()
				waitFor(b, "new certificate", func() bool {
					_, ok := rec.firstSince(kp.Cert.Subject.CommonName, written)
					return ok
				})
				at, _ := rec.firstSince(kp.Cert.Subject.CommonName, written)
				lat = append(lat, at.Sub(written))
			}
			b.StopTimer()
			close(stop)
			<-done
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(float64(lat[len(lat)/2].Milliseconds()), "median-ms")
			b.ReportMetric(float64(lat[len(lat)-1].Milliseconds()), "worst-ms")
			b.ReportMetric(float64(fails.Load()), "failed-requests")
		})
	}
}

// BenchmarkColdStartBurst: 300 concurrent first requests through a new
// client (server latency 20 ms), client-go alone beside the pool; and, for
// the pool, the same burst sent while the identity's first request is a list
// the server takes 500 ms over. Reported: connections the server accepted and
// held open at once per burst, and the 99th percentile latency of the burst's
// requests.
func BenchmarkColdStartBurst(b *testing.B) {
	const n = 300
	var slowSeen atomic.Int64
	f := newFixture(b, testserver.Options{Latency: 20 * time.Millisecond, OnRequest: func(ri testserver.RequestInfo) {
		if strings.Contains(ri.UserAgent, "slow") {
			slowSeen.Add(1)
			time.Sleep(500 * time.Millisecond)
		}
	}})
	for _, mode := range []string{"client-go", "pool", "pool, first list slow"} {
		b.Run(strings.ReplaceAll(mode, " ", "_"), func(b *testing.B) {
			var accepted, peak uint64
			var p99 time.Duration
			for b.Loop() {
				f.srv.CloseClientConnections()
				waitFor(b, "connections closed", func() bool { return f.srv.OpenConns() == 0 })
				f.srv.ResetStats()
				cfg := f.srv.RestConfig(f.alice)
				cfg.QPS = -1
				cfg.Proxy = nilProxy // client-go: a transport of its own, cold
				clientset := func(cfg *rest.Config) (kubernetes.Interface, error) { return kubernetes.NewForConfig(cfg) }
				if mode != "client-go" {
					p := newPool(b)
					clientset = func(cfg *rest.Config) (kubernetes.Interface, error) { return pooledClientset(p, cfg) }
				}
				cs, err := clientset(cfg)
				if err != nil {
					b.Fatal(err)
				}
				var slow chan error
				if mode == "pool, first list slow" {
					slowCfg := rest.CopyConfig(cfg) // same identity, its own user agent
					slowCfg.UserAgent = "slow"
					slowCS, err := clientset(slowCfg)
					if err != nil {
						b.Fatal(err)
					}
					seen := slowSeen.Load()
					slow = make(chan error, 1)
					go func() {
						_, err := slowCS.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
						slow <- err
					}()
					waitFor(b, "the slow list reaches the server", func() bool { return slowSeen.Load() > seen })
				}
				lat := make([]time.Duration, n)
				start := make(chan struct{})
				var wg sync.WaitGroup
				var failed atomic.Int64
				for i := range n {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						t0 := time.Now()
						if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
							failed.Add(1)
						}
						lat[i] = time.Since(t0)
					}()
				}
				close(start)
				wg.Wait()
				if slow != nil {
					if err := <-slow; err != nil {
						b.Fatal(err)
					}
				}
				if failed.Load() > 0 {
					b.Fatalf("%d requests failed", failed.Load())
				}
				sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
				st := f.srv.Stats()
				accepted += st.Accepted
				peak += uint64(st.PeakOpen)
				p99 += lat[n*99/100]
			}
			b.ReportMetric(float64(accepted)/float64(b.N), "conns/op")
			b.ReportMetric(float64(peak)/float64(b.N), "peak-open/op")
			b.ReportMetric(float64(p99.Microseconds())/1000/float64(b.N), "p99-ms")
		})
	}
}

// BenchmarkStreamsBeside: 50 lists sent at once beside 100 requests busy on
// the one connection of a server allowing 250 streams (held by the server,
// or answered and left unread), through client-go alone and through the
// pool, side by side. A gate that counted 100 streams per connection sent
// them one per 10 ms: about 500 ms an operation.
func BenchmarkStreamsBeside(b *testing.B) {
	for _, tc := range streamsBesideClients {
		for _, busy := range []string{"100 held", "100 unread"} {
			b.Run(tc.name+", "+busy, func(b *testing.B) {
				f, client := streamsBeside(b, tc.client, busy)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
				defer cancel()
				b.ResetTimer()
				for range b.N {
					if _, err := concurrentGets(ctx, client, f.srv.URL(), "beside", 50); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
