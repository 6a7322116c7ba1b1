package sharedtransport

import (
	"context"
	"fmt"
	"io"
	"k8s.io/client-go/kubernetes"
	"net/http"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// BenchmarkRoundTrip: what the pool adds per request. "http.Transport" is
// the baseline (a transport built as client-go builds one), "pool" the same
// request through the pool's round tripper, "pool, no-op base" the pool's
// layer alone over a round tripper that does nothing.
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
	b.Run("pool, no-op base", func(b *testing.B) {
		p := newPool(b)
		l := benchLease(b, p, rest.CopyConfig(cfg))
		l.e.current.Load().choice.Store(&choice{rt: noopRT{}})
		r := req()
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if _, err := l.RoundTrip(r); err != nil {
				b.Fatal(err)
			}
		}
	})
}

type noopRT struct{}

var noopResponse = &http.Response{StatusCode: http.StatusOK, Body: http.NoBody}

func (noopRT) RoundTrip(*http.Request) (*http.Response, error) { return noopResponse, nil }

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

// benchConfigs are inline and file material, and file material with a
// Proxy (which client-go cannot cache). Each carries a bearer token, as a
// member config does.
func benchConfigs(b *testing.B, f *fixture) []benchConfig {
	paths := f.kubeconfig(b, "alice", f.alice)
	return []benchConfig{
		{"inline", func() *rest.Config {
			c := f.srv.RestConfig(f.alice)
			c.BearerToken = "token"
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
// exists), for inline and file material and a sampled Proxy.
func BenchmarkWrap(b *testing.B) {
	f := newFixture(b, testserver.Options{})
	for _, tc := range benchConfigs(b, f) {
		b.Run(tc.name, func(b *testing.B) {
			p := newPool(b)
			b.ReportAllocs()
			for b.Loop() {
				if err := p.Wrap(tc.cfg()); err != nil {
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
			{"Wrap+rest.TransportFor", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) {
				if err := p.Wrap(cfg); err != nil {
					return nil, err
				}
				return rest.TransportFor(cfg)
			}},
			{"pool.TransportFor", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) { return p.TransportFor(cfg) }},
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
// clientset, from parallel goroutines. Reported beside time: connections the
// server accepted and full TLS handshakes, per request.
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
	for _, mode := range []struct {
		name    string
		prepare func(b *testing.B) func(*rest.Config) error
	}{
		{"client-go", func(*testing.B) func(*rest.Config) error { return func(*rest.Config) error { return nil } }},
		{"client-go keep-alive off (Karmada)", func(*testing.B) func(*rest.Config) error {
			return func(cfg *rest.Config) error {
				tlsConfig, err := rest.TLSConfigFor(cfg)
				if err != nil {
					return err
				}
				cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper {
					return utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: tlsConfig, DisableKeepAlives: true})
				}
				return nil
			}
		}},
		{"pool", func(b *testing.B) func(*rest.Config) error { return newPool(b).Wrap }},
		{"pool keep-alive off", func(b *testing.B) func(*rest.Config) error { return newPool(b, WithKeepAlive(false)).Wrap }},
		{"pool keep-alive off, no resumption", func(b *testing.B) func(*rest.Config) error {
			return newPool(b, WithKeepAlive(false), WithSessionResumption(false)).Wrap
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
					cfg := newConfig()
					if err := prepare(cfg); err != nil {
						b.Error(err)
						return
					}
					if err := listNodes(context.Background(), cfg); err != nil {
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
// -benchtime 1x). The "poll only" row turns file events off.
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
	for _, kind := range []string{inPlace, renameOver, secretVolume, deleteCreate, certThenKey, "poll only"} {
		b.Run(strings.ReplaceAll(kind, " ", "_"), func(b *testing.B) {
			opts := []Option{WithPollInterval(0), WithDrainTimeout(time.Second)}
			layout := kind
			if kind == "poll only" {
				layout = secretVolume
				opts = []Option{WithPollInterval(time.Second), func(o *options) { o.disableNotify = true }}
			}
			p := newPool(b, opts...)
			d := newCertDir(b, layout, f.alice, f.ca.CertPEM())
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
