package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedtransport/sharedtransport"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// modeDef is one way of building the client for each request. A mode runs
// in a client process of its own (clientRole): start runs there, once.
type modeDef struct {
	name, desc string
	start      func(o *clientSpec) *modeState
}

// modeState is a mode while it runs.
type modeState struct {
	// prepare adjusts the fresh config of one request.
	prepare func(cfg *rest.Config) error
	// clientset builds the clientset for one request's config; nil means
	// kubernetes.NewForConfig, as most callers do.
	clientset func(cfg *rest.Config) (kubernetes.Interface, error)
	// finish releases what the mode holds before its process exits.
	finish func()
	// pool, when the mode uses one, reports its Stats.
	pool *sharedtransport.Pool
}

// noProxy is a Proxy function that sends every request direct: what Karmada's
// member-cluster configs carry, and enough to make client-go build a new,
// uncached transport for every config.
func noProxy(*http.Request) (*url.URL, error) { return nil, nil }

func clientGoMode(withProxy bool) func(*clientSpec) *modeState {
	return func(*clientSpec) *modeState {
		return &modeState{
			prepare: func(cfg *rest.Config) error {
				if withProxy {
					cfg.Proxy = noProxy
				}
				return nil
			},
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
func karmadaKeepAliveOff(*clientSpec) *modeState {
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
	}
}

// sharedTransportMode is the pool per request's config: with Proxy set
// (Karmada's member-cluster shape), through the pool's HTTPClientFor and
// kubernetes.NewForConfigAndClient, so client-go builds no transport of its
// own (Wrap passes a config with a Proxy through); without, through Wrap.
func sharedTransportMode(keepAlive, resumption, withProxy bool) func(*clientSpec) *modeState {
	return func(o *clientSpec) *modeState {
		opts := []sharedtransport.Option{
			sharedtransport.WithKeepAlive(keepAlive),
			sharedtransport.WithSessionResumption(resumption),
		}
		pool := sharedtransport.New(opts...)
		st := &modeState{
			prepare: func(cfg *rest.Config) error { return pool.Wrap(cfg) },
			finish:  func() { _ = pool.Close() },
			pool:    pool,
		}
		if withProxy {
			st.prepare = func(cfg *rest.Config) error {
				cfg.Proxy = noProxy
				if cfg.UserAgent == "" {
					cfg.UserAgent = rest.DefaultKubernetesUserAgent() // what kubernetes.NewForConfig sends
				}
				return nil
			}
			st.clientset = func(cfg *rest.Config) (kubernetes.Interface, error) {
				hc, err := pool.HTTPClientFor(cfg)
				if err != nil {
					return nil, err
				}
				return kubernetes.NewForConfigAndClient(cfg, hc)
			}
		}
		return st
	}
}

// floorMode is a measuring stick, unsafe in general: one *http.Client from
// the pool's HTTPClientFor for the first config, shared by every config
// whatever its identity. It costs what sharedtransport costs but the pool's
// and client-go's work per config, which no per-config entry point can
// spare entirely.
func floorMode(o *clientSpec) *modeState {
	st := sharedTransportMode(true, true, true)(o)
	var (
		once sync.Once
		hc   *http.Client
		err  error
	)
	st.clientset = func(cfg *rest.Config) (kubernetes.Interface, error) {
		once.Do(func() { hc, err = st.pool.HTTPClientFor(cfg) })
		if err != nil {
			return nil, err
		}
		return kubernetes.NewForConfigAndClient(cfg, hc)
	}
	return st
}

// floorWrapMode is floor's counterpart for Wrap, as unsafe: the cheapest
// WrapTransport hook there is, which discards the transport client-go built
// for the config and returns one round tripper, the pool's for the first
// config, to every config. What sharedtransport-wrap costs beyond it is the
// pool's hook; what both cost beyond floor is client-go's work per config
// before any hook runs.
func floorWrapMode(o *clientSpec) *modeState {
	st := sharedTransportMode(true, true, false)(o)
	var (
		once sync.Once
		rt   http.RoundTripper
		err  error
	)
	st.prepare = func(cfg *rest.Config) error {
		once.Do(func() { rt, err = st.pool.TransportFor(rest.CopyConfig(cfg)) })
		if err != nil {
			return err
		}
		cfg.WrapTransport = func(http.RoundTripper) http.RoundTripper { return rt }
		return nil
	}
	return st
}

// allModes are the main command's modes. A new mode is one more entry: its
// start builds what the mode keeps (a pool), its modeState says how a
// request's config and clientset are made. Every column, the server's CPU
// included, is measured the same way for every entry.
var allModes = []modeDef{
	{"client-go", "client-go as is: fresh rest.Config + clientset per request (client-go's transport cache applies)", clientGoMode(false)},
	{"client-go-proxy", "the same with rest.Config.Proxy set (Karmada's member-cluster configs): client-go cannot cache the transport", clientGoMode(true)},
	{"client-go-keepalive-off", "Karmada's fix: a new transport per request with DisableKeepAlives, built before HTTP/2 is configured", karmadaKeepAliveOff},
	{"sharedtransport", "this library's HTTPClientFor + kubernetes.NewForConfigAndClient per request, Proxy set as in Karmada: client-go builds no transport", sharedTransportMode(true, true, true)},
	{"sharedtransport-keepalive-off", "the same, keep-alive off (TLS session resumption on)", sharedTransportMode(false, true, true)},
	{"sharedtransport-wrap", "this library's Wrap, no Proxy (Wrap passes a config with a Proxy through): client-go's own transport cache hits too (compare with client-go)", sharedTransportMode(true, true, false)},
	{"sharedtransport-keepalive-off-no-resumption", "HTTPClientFor, keep-alive off and TLS session resumption off, Proxy set", sharedTransportMode(false, false, true)},
	{"floor", "a measuring stick, unsafe in general: one http.Client from HTTPClientFor, built once and shared by every config whatever its identity (no per-config entry point can cost less); Proxy set", floorMode},
	{"floor-wrap", "floor for Wrap, as unsafe: a WrapTransport hook that discards client-go's transport and returns one round tripper for every config (no hook can cost less); no Proxy", floorWrapMode},
}

var defaultModes = []string{"client-go", "client-go-proxy", "client-go-keepalive-off", "sharedtransport", "sharedtransport-keepalive-off", "sharedtransport-wrap", "floor", "floor-wrap"}

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

// ---- the client process ----

// clientSpec is what the parent tells a mode's client process.
type clientSpec struct {
	Kubeconfig string        `json:"kubeconfig"`
	Mode       string        `json:"mode"`
	Workers    int           `json:"workers"`
	Requests   int           `json:"requests"`
	Resource   string        `json:"resource"`
	Timeout    time.Duration `json:"timeout"`
	Duration   time.Duration `json:"duration"`
	// CPUProfile, when set, is the file the load's CPU profile goes to.
	CPUProfile string `json:"cpu_profile,omitempty"`
	// Label prefixes the progress lines (empty: no progress).
	Label string `json:"label,omitempty"`
}

type clientReady struct {
	PID int `json:"pid"`
}

// clientResult is what a client process measured of its own load.
type clientResult struct {
	// PID is the process the load ran in; ProcessRequests the requests that
	// process sent over its life, which is this load's alone.
	PID             int   `json:"client_pid"`
	ProcessRequests int64 `json:"client_process_requests"`
	loadFigures
	CPUSeconds      float64                `json:"cpu_seconds"`
	CPUPerRequestUs float64                `json:"cpu_per_request_us"`
	PeakHeapBytes   uint64                 `json:"peak_heap_bytes"`
	MaxRSSBytes     int64                  `json:"max_rss_bytes"`
	Pool            *sharedtransport.Stats `json:"pool_stats,omitempty"`
}

// processRequests counts the requests this process sends; in a client
// process of its own it equals the one load's requests.
var processRequests atomic.Int64

type clientRole struct {
	spec  clientSpec
	base  *rest.Config
	def   *modeDef
	state *modeState
	ran   bool
}

func startClientRole(specJSON []byte) (any, childRole, error) {
	var spec clientSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	def := findMode(spec.Mode)
	if def == nil {
		return nil, nil, fmt.Errorf("unknown mode %q", spec.Mode)
	}
	base, err := loadKubeconfig(spec.Kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	return clientReady{PID: os.Getpid()}, &clientRole{spec: spec, base: base, def: def, state: def.start(&spec)}, nil
}

// handle runs the load on "run", once: a second load in the same process
// would be measured with the first one's leftovers.
func (c *clientRole) handle(ctx context.Context, cmd string) (any, error) {
	if cmd != "run" {
		return nil, fmt.Errorf("unknown command %q", cmd)
	}
	if c.ran {
		return nil, errors.New("a client process runs its mode once")
	}
	c.ran = true
	if c.spec.CPUProfile != "" {
		f, err := os.Create(c.spec.CPUProfile)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return nil, err
		}
		defer pprof.StopCPUProfile()
	}
	return runLoad(ctx, &c.spec, c.base, c.state), nil
}

func (c *clientRole) close() {
	if c.state.finish != nil {
		c.state.finish()
	}
}

// runLoad runs the spec's workers, each sending its requests one after the
// other, every request through a fresh config and clientset.
func runLoad(ctx context.Context, o *clientSpec, base *rest.Config, st *modeState) *clientResult {
	var done, failed atomic.Int64
	var firstErr atomic.Value
	lat := make([][]time.Duration, o.Workers)
	total := o.Workers * o.Requests
	var progress *progressLine
	if o.Label != "" {
		progress = newProgressLine(os.Stderr)
	}
	show := func(start time.Time, final bool) {
		progress.show(fmt.Sprintf("%s %6d/%d requests  %d errors  %5.1fs",
			o.Label, done.Load(), total, failed.Load(), time.Since(start).Seconds()), final)
	}
	heap := startHeapSampler(20 * time.Millisecond)
	cpu0 := selfUsage().CPU
	start := time.Now()
	var deadline time.Time
	if o.Duration > 0 {
		deadline = start.Add(o.Duration)
	}
	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopProgress:
				show(start, true)
				return
			case <-tick.C:
				show(start, false)
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range o.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat[w] = make([]time.Duration, 0, o.Requests)
			for range o.Requests {
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
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	u := selfUsage()
	close(stopProgress)
	<-progressDone

	res := &clientResult{
		PID:             os.Getpid(),
		ProcessRequests: processRequests.Load(),
		loadFigures:     loadFigures{Requests: done.Load(), Errors: failed.Load(), Seconds: elapsed.Seconds()},
		CPUSeconds:      (u.CPU - cpu0).Seconds(),
		PeakHeapBytes:   heap.Stop(),
		MaxRSSBytes:     u.MaxRSSKiB * 1024,
	}
	if s, ok := firstErr.Load().(string); ok {
		res.FirstError = s
	}
	if st.pool != nil {
		ps := st.pool.Stats()
		res.Pool = &ps
	}
	if res.Requests > 0 {
		res.RequestsPerSecond = float64(res.Requests) / elapsed.Seconds()
		res.CPUPerRequestUs = (u.CPU - cpu0).Seconds() * 1e6 / float64(res.Requests)
	}
	res.P50ms, res.P99ms = latencyPercentiles(lat)
	return res
}

// latencyPercentiles returns the 50th and 99th percentiles of all the
// workers' latencies, in milliseconds.
func latencyPercentiles(lat [][]time.Duration) (p50, p99 float64) {
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	slices.Sort(all)
	return percentile(all, 0.50), percentile(all, 0.99)
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

func oneRequest(ctx context.Context, o *clientSpec, base *rest.Config, st *modeState) error {
	processRequests.Add(1)
	cfg := rest.CopyConfig(base)
	if err := st.prepare(cfg); err != nil {
		return err
	}
	newClientset := st.clientset
	if newClientset == nil {
		newClientset = func(cfg *rest.Config) (kubernetes.Interface, error) { return kubernetes.NewForConfig(cfg) }
	}
	cs, err := newClientset(cfg)
	if err != nil {
		return err
	}
	rctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	return list(rctx, cs, o.Resource, 0)
}

// loadFigures are what every load process reports of the requests it sent.
type loadFigures struct {
	Requests          int64   `json:"requests"`
	Errors            int64   `json:"errors"`
	FirstError        string  `json:"first_error,omitempty"`
	Seconds           float64 `json:"seconds"`
	RequestsPerSecond float64 `json:"requests_per_second"`
	P50ms             float64 `json:"p50_ms"`
	P99ms             float64 `json:"p99_ms"`
}
