package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"reflect"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sharedtransport/sharedtransport"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// modeDef is one way of building the client for each request.
type modeDef struct {
	name, desc string
	start      func(o *options) *modeState
}

// modeState is a mode while it runs.
type modeState struct {
	// prepare adjusts the fresh config of one request.
	prepare func(cfg *rest.Config) error
	// finish runs after the mode's counts are taken: it releases what the
	// mode kept (idle connections), so the next mode starts clean.
	finish func()
	pool   *sharedtransport.Pool
}

// noProxy is a Proxy function that sends every request direct: what Karmada's
// member-cluster configs carry, and enough to make client-go build a new,
// uncached transport for every config.
func noProxy(*http.Request) (*url.URL, error) { return nil, nil }

// transportRecorder remembers the transports client-go handed to
// WrapTransport, without changing them (WrapTransport is not part of
// client-go's transport cache key), so their idle connections can be closed
// when the mode ends instead of lingering for client-go's 90-second idle
// timeout and being counted in the next mode.
type transportRecorder struct {
	mu  sync.Mutex
	rts map[http.RoundTripper]struct{}
}

func (r *transportRecorder) wrap(cfg *rest.Config) {
	inner := cfg.WrapTransport
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		if inner != nil {
			rt = inner(rt)
		}
		if rt != nil && reflect.TypeOf(rt).Comparable() {
			r.mu.Lock()
			if r.rts == nil {
				r.rts = map[http.RoundTripper]struct{}{}
			}
			r.rts[rt] = struct{}{}
			r.mu.Unlock()
		}
		return rt
	}
}

func (r *transportRecorder) closeIdle() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for rt := range r.rts {
		utilnet.CloseIdleConnectionsFor(rt)
	}
	r.rts = nil
}

func clientGoMode(withProxy bool) func(*options) *modeState {
	return func(*options) *modeState {
		rec := &transportRecorder{}
		return &modeState{
			prepare: func(cfg *rest.Config) error {
				if withProxy {
					cfg.Proxy = noProxy
				}
				rec.wrap(cfg)
				return nil
			},
			finish: rec.closeIdle,
		}
	}
}

// karmadaKeepAliveOff mirrors Karmada's merged fix (PR 5610,
// pkg/util/proxy/proxy.go createProxyTransport): for every proxied request
// a new *http.Transport is built from the cluster's TLS config with
// DisableKeepAlives set, and only then passed to
// utilnet.SetTransportDefaults, which configures HTTP/2 on it, so HTTP/2
// connections are not kept alive either. Here it is installed through
// WrapTransport, so client-go still adds the config's authentication
// (bearer token, user agent) above it; the round tripper client-go hands in
// is not used.
func karmadaKeepAliveOff(*options) *modeState {
	return &modeState{
		prepare: func(cfg *rest.Config) error {
			tlsConfig, err := rest.TLSConfigFor(cfg)
			if err != nil {
				return err
			}
			cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper {
				return utilnet.SetTransportDefaults(&http.Transport{
					TLSClientConfig:   tlsConfig,
					DisableKeepAlives: true,
				})
			}
			return nil
		},
		finish: func() {},
	}
}

func sharedTransportMode(keepAlive, resumption, withProxy bool) func(*options) *modeState {
	return func(o *options) *modeState {
		opts := []sharedtransport.Option{
			sharedtransport.WithKeepAlive(keepAlive),
			sharedtransport.WithSessionResumption(resumption),
		}
		if o.maxConnsPerHost > 0 {
			opts = append(opts, sharedtransport.WithMaxConnsPerHost(o.maxConnsPerHost))
		}
		pool := sharedtransport.New(opts...)
		return &modeState{
			prepare: func(cfg *rest.Config) error {
				if withProxy {
					cfg.Proxy = noProxy // Karmada's member-cluster shape
				}
				return pool.Wrap(cfg)
			},
			finish: func() { _ = pool.Close() },
			pool:   pool,
		}
	}
}

var allModes = []modeDef{
	{"client-go", "client-go as is: fresh rest.Config + clientset per request (client-go's transport cache applies)", clientGoMode(false)},
	{"client-go-proxy", "the same with rest.Config.Proxy set (Karmada's member-cluster configs): client-go cannot cache the transport", clientGoMode(true)},
	{"client-go-keepalive-off", "Karmada's fix: a new transport per request with DisableKeepAlives, built before HTTP/2 is configured", karmadaKeepAliveOff},
	{"sharedtransport", "this library, keep-alive on, Proxy set as in Karmada", sharedTransportMode(true, true, true)},
	{"sharedtransport-keepalive-off", "this library, keep-alive off (TLS session resumption on), Proxy set", sharedTransportMode(false, true, true)},
	{"sharedtransport-no-proxy", "this library, keep-alive on, no Proxy: client-go's own transport cache hits too (compare with client-go)", sharedTransportMode(true, true, false)},
	{"sharedtransport-keepalive-off-no-resumption", "this library, keep-alive off and TLS session resumption off, Proxy set", sharedTransportMode(false, false, true)},
}

var defaultModes = []string{"client-go", "client-go-proxy", "client-go-keepalive-off", "sharedtransport", "sharedtransport-keepalive-off"}

func modeNames() []string {
	var out []string
	for _, m := range allModes {
		out = append(out, m.name)
	}
	return out
}

func findMode(name string) *modeDef {
	for i := range allModes {
		if allModes[i].name == name {
			return &allModes[i]
		}
	}
	return nil
}

func list(ctx context.Context, cs kubernetes.Interface, resource string, limit int64) error {
	var err error
	switch resource {
	case "namespaces":
		_, err = cs.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: limit})
	default:
		_, err = cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{Limit: limit})
	}
	return err
}

// preflight makes one request on a throwaway transport, so that bad input
// fails within seconds with a message that says what is wrong.
func preflight(ctx context.Context, base *rest.Config, resource string) error {
	cfg := rest.CopyConfig(base)
	cfg.Timeout = 5 * time.Second
	cfg.Proxy = noProxy // a transport of its own, closed below
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return fmt.Errorf("build a client for %s: %w", cfg.Host, err)
	}
	defer utilnet.CloseIdleConnectionsFor(hc.Transport)
	cs, err := kubernetes.NewForConfigAndClient(cfg, hc)
	if err != nil {
		return err
	}
	err = list(ctx, cs, resource, 1)
	var status apierrors.APIStatus
	switch {
	case err == nil:
		return nil
	case apierrors.IsForbidden(err):
		return fmt.Errorf("the API server %s forbids verb \"list\" on resource %q for this kubeconfig's user (conncount needs it; try --resource namespaces or nodes): %v", cfg.Host, resource, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("the API server %s did not accept this kubeconfig's credentials (401 Unauthorized): %v", cfg.Host, err)
	case errors.As(err, &status):
		return fmt.Errorf("verb \"list\" on resource %q at %s failed: %v", resource, cfg.Host, err)
	default:
		return fmt.Errorf("cannot reach API server %s: %v", cfg.Host, err)
	}
}

type sample struct {
	T    float64 `json:"t"`
	Open int     `json:"open"`
}

type modeResult struct {
	Mode              string                 `json:"mode"`
	Description       string                 `json:"description"`
	Requests          int64                  `json:"requests"`
	Errors            int64                  `json:"errors"`
	FirstError        string                 `json:"first_error,omitempty"`
	Accepted          int64                  `json:"connections_accepted"`
	PeakOpen          int64                  `json:"peak_open"`
	OpenAtEnd         int64                  `json:"open_at_end"`
	FullHandshakes    int64                  `json:"full_handshakes"`
	Resumed           int64                  `json:"resumed_handshakes"`
	HandshakeSource   string                 `json:"handshake_source"`
	Seconds           float64                `json:"seconds"`
	RequestsPerSecond float64                `json:"requests_per_second"`
	P50ms             float64                `json:"p50_ms"`
	P99ms             float64                `json:"p99_ms"`
	CPUSeconds        float64                `json:"cpu_seconds"`
	CPUPerRequestUs   float64                `json:"cpu_per_request_us"`
	VsClientGo        *ratios                `json:"vs_client_go,omitempty"`
	Pool              *sharedtransport.Stats `json:"pool_stats,omitempty"`
	Samples           []sample               `json:"-"`
}

type ratios struct {
	Connections       float64 `json:"connections"`
	RequestsPerSecond float64 `json:"requests_per_second"`
	CPUPerRequest     float64 `json:"cpu_per_request"`
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func runMode(ctx context.Context, o *options, t target, def *modeDef, progress io.Writer) (*modeResult, error) {
	st := def.start(o)
	finished := false
	defer func() {
		if !finished {
			st.finish()
		}
	}()
	if err := t.Reset(); err != nil {
		return nil, err
	}
	base := t.Config()
	var done, failed atomic.Int64
	var firstErr atomic.Value
	lat := make([][]time.Duration, o.workers)
	total := int64(o.workers * o.requests)

	// Sample open connections (the --svg picture; the peak on real clusters)
	// and show progress.
	stopSampling := make(chan struct{})
	sampled := make(chan []sample, 1)
	start := time.Now()
	go func() {
		var samples []sample
		tick := time.NewTicker(o.sample)
		defer tick.Stop()
		tty := progress != nil && isTerminal(progress)
		every := time.Second
		if tty {
			every = 200 * time.Millisecond
		}
		lastShown := time.Now()
		show := func(open int, final bool) {
			if progress == nil {
				return
			}
			line := fmt.Sprintf("%-30s %6d/%d requests  %d errors  %5d open  %5.1fs",
				def.name, done.Load(), total, failed.Load(), open, time.Since(start).Seconds())
			switch {
			case tty && final:
				fmt.Fprintf(progress, "\r%s\033[K\n", line)
			case tty:
				fmt.Fprintf(progress, "\r%s\033[K", line)
			default:
				fmt.Fprintln(progress, line)
			}
		}
		last := 0
		for {
			select {
			case <-stopSampling:
				show(last, true)
				sampled <- samples
				return
			case <-tick.C:
				if n, err := t.Open(); err == nil {
					last = n
					samples = append(samples, sample{T: time.Since(start).Seconds(), Open: n})
				}
				if time.Since(lastShown) >= every {
					lastShown = time.Now()
					show(last, false)
				}
			}
		}
	}()

	cpu0 := cpuTime()
	var deadline time.Time
	if o.duration > 0 {
		deadline = start.Add(o.duration)
	}
	var wg sync.WaitGroup
	for w := 0; w < o.workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			lat[w] = make([]time.Duration, 0, o.requests)
			for i := 0; i < o.requests; i++ {
				if ctx.Err() != nil || (!deadline.IsZero() && time.Now().After(deadline)) {
					return
				}
				t0 := time.Now()
				err := oneRequest(ctx, o, base, st)
				lat[w] = append(lat[w], time.Since(t0))
				done.Add(1)
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu := cpuTime() - cpu0
	close(stopSampling)
	samples := <-sampled
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	c, err := t.Counts()
	if err != nil {
		return nil, err
	}
	res := &modeResult{
		Mode:            def.name,
		Description:     def.desc,
		Requests:        done.Load(),
		Errors:          failed.Load(),
		Accepted:        c.Accepted,
		PeakOpen:        c.PeakOpen,
		OpenAtEnd:       c.Open,
		FullHandshakes:  c.FullHandshakes,
		Resumed:         c.Resumed,
		HandshakeSource: "server",
		Seconds:         elapsed.Seconds(),
		CPUSeconds:      cpu.Seconds(),
		Samples:         samples,
	}
	if s, ok := firstErr.Load().(string); ok {
		res.FirstError = s
	}
	for _, s := range samples {
		if int64(s.Open) > res.PeakOpen {
			res.PeakOpen = int64(s.Open)
		}
	}
	if st.pool != nil {
		ps := st.pool.Stats()
		res.Pool = &ps
	}
	if res.FullHandshakes == unknown {
		if res.Pool != nil {
			res.FullHandshakes, res.Resumed = int64(res.Pool.Handshakes), int64(res.Pool.Resumptions)
			res.HandshakeSource = "library Stats"
		} else {
			res.FullHandshakes, res.Resumed = res.Accepted, 0
			res.HandshakeSource = "inferred (one per connection)"
		}
	}
	if res.Requests > 0 {
		res.RequestsPerSecond = float64(res.Requests) / elapsed.Seconds()
		res.CPUPerRequestUs = float64(cpu.Microseconds()) / float64(res.Requests)
	}
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	res.P50ms = percentile(all, 0.50)
	res.P99ms = percentile(all, 0.99)

	finished = true
	st.finish()
	return res, nil
}

func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.5) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(sorted) {
		i = len(sorted) - 1
	}
	return float64(sorted[i].Microseconds()) / 1000
}

func oneRequest(ctx context.Context, o *options, base *rest.Config, st *modeState) error {
	cfg := rest.CopyConfig(base)
	if err := st.prepare(cfg); err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	rctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	return list(rctx, cs, o.resource, 0)
}
