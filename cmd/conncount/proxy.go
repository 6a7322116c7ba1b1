package main

// conncount proxy: the seed's own scenario. Karmada's aggregated apiserver
// proxies requests to member clusters and builds each member's config from
// its Secret for every request (internal/memberproxy). The load goes through
// that front to embedded member servers, which count the connections they
// accept. Every run has fresh processes of its own: the members, the front
// and the load, so that the front's and the members' CPU time and memory are
// theirs alone.

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
	"k8s.io/client-go/rest"
)

// proxyModeDef is one way the front gets its round trippers.
type proxyModeDef struct {
	name, desc string
	// newFront builds the front of one run, in the front's own process. The
	// pool, when the mode uses one, reports its Stats and is closed with the
	// process.
	newFront func(clusters *memberproxy.Clusters) (*memberproxy.Front, *sharedtransport.Pool)
}

// frontWith is a front in mode m, through the pool's TransportFor with opts
// when opts is not nil.
func frontWith(m memberproxy.Mode, opts []sharedtransport.Option) func(*memberproxy.Clusters) (*memberproxy.Front, *sharedtransport.Pool) {
	return func(clusters *memberproxy.Clusters) (*memberproxy.Front, *sharedtransport.Pool) {
		f := &memberproxy.Front{Clusters: clusters, Mode: m}
		if opts == nil {
			return f, nil
		}
		pool := sharedtransport.New(opts...)
		// The member's ProxyHeader wrapper is declared, as Karmada would.
		f.TransportFor = func(cfg *rest.Config, h http.Header) (http.RoundTripper, error) {
			return pool.TransportFor(cfg, sharedtransport.WithProxyConnectHeader(h))
		}
		return f, pool
	}
}

// proxyModes are the proxy subcommand's modes; a new way for the front to
// get its round tripper is one more entry with a newFront of its own.
var proxyModes = []proxyModeDef{
	{"new-transport", "Karmada before PR 5610: a new transport per request (issue 5574)", frontWith(memberproxy.NewTransport, nil)},
	{"new-transport-keepalive-off", "Karmada since PR 5610: a new transport per request, keep-alive off", frontWith(memberproxy.NewTransportNoKeepAlive, nil)},
	{"sharedtransport", "the pool's TransportFor in place of rest.TransportFor (one line in the front)", frontWith(memberproxy.TransportFor, []sharedtransport.Option{})},
	{"sharedtransport-keepalive-off", "the same, the pool with keep-alive off (TLS session resumption on)", frontWith(memberproxy.TransportFor, []sharedtransport.Option{sharedtransport.WithKeepAlive(false)})},
}

var defaultProxyModes = []string{"new-transport", "new-transport-keepalive-off", "sharedtransport"}

// Defaults of the proxy load, chosen as defaultRequests and defaultRepeat.
const (
	defaultProxyRequests = 20
	defaultProxyRepeat   = 5
)

type proxyOptions struct {
	members, workers, requests, repeat int
	modes                              []string
	json                               bool
	timeout                            time.Duration
	progress                           bool
	scrape                             bool
}

func parseProxyFlags(args []string, stderr io.Writer) (*proxyOptions, error) {
	o := &proxyOptions{}
	fs := flag.NewFlagSet("conncount proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var modes string
	fs.IntVar(&o.members, "members", 3, "member clusters behind the front (odd ones authenticate the front by client certificate, even ones by token; member-3, member-6, ... are reached through a CONNECT proxy that requires a Proxy-Authorization header)")
	fs.IntVar(&o.workers, "workers", defaultWorkers, "concurrent clients of the front")
	fs.IntVar(&o.requests, "requests", defaultProxyRequests, "requests per client, spread over the members")
	fs.IntVar(&o.repeat, "repeat", defaultProxyRepeat, "rounds of all modes; each figure is the median of the rounds, with its range")
	fs.StringVar(&modes, "modes", strings.Join(defaultProxyModes, ","), "comma-separated modes to run, in order (round r starts at the r-th)")
	fs.BoolVar(&o.json, "json", false, "print the results as JSON instead of a table")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "timeout of one request")
	fs.BoolVar(&o.progress, "progress", true, "show progress on stderr while a mode runs")
	fs.BoolVar(&o.scrape, "scrape", false, "pool modes: serve the pool's Prometheus collector (metrics/prometheus) from the front's process on loopback, scrape it after the load, and print the scrape of each pool mode's last run")
	var modeHelp [][2]string
	for _, m := range proxyModes {
		modeHelp = append(modeHelp, [2]string{m.name, m.desc})
	}
	if err := parseFlagSet(fs, args, "Usage: conncount proxy [flags]\n\nRuns the seed's load through a Karmada-style front (a rest.Config per request, built from the\nmember's Secret) to embedded member servers, which count the connections they accept. Modes:\n", modeHelp); err != nil {
		return nil, err
	}
	if o.members < 1 || o.workers < 1 || o.requests < 1 || o.repeat < 1 {
		return nil, fmt.Errorf("%w: --members, --workers, --requests and --repeat must be at least 1", errUsage)
	}
	for _, name := range strings.Split(modes, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if findProxyMode(name) == nil {
			var known []string
			for _, m := range proxyModes {
				known = append(known, m.name)
			}
			return nil, fmt.Errorf("%w: unknown mode %q (known: %s)", errUsage, name, strings.Join(known, ", "))
		}
		if slices.Contains(o.modes, name) {
			return nil, fmt.Errorf("%w: mode %q given twice (--repeat runs it again)", errUsage, name)
		}
		o.modes = append(o.modes, name)
	}
	if len(o.modes) == 0 {
		return nil, fmt.Errorf("%w: --modes is empty", errUsage)
	}
	return o, nil
}

func findProxyMode(name string) *proxyModeDef {
	for i := range proxyModes {
		if proxyModes[i].name == name {
			return &proxyModes[i]
		}
	}
	return nil
}

type memberResult struct {
	Name      string `json:"name"`
	Auth      string `json:"auth"`
	URL       string `json:"url"`
	ProxyURL  string `json:"proxy_url,omitempty"` // the CONNECT proxy the front reaches it through
	Requests  int64  `json:"requests"`
	Accepted  uint64 `json:"connections_accepted"`
	Full      uint64 `json:"full_handshakes"`
	Resumed   uint64 `json:"resumed_handshakes"`
	OpenAtEnd int    `json:"open_at_end"`
	// Tunnels the CONNECT proxy opened to the member; nil when the front
	// reaches it directly.
	ProxyTunnels *uint64 `json:"proxy_tunnels,omitempty"`
}

// proxyRun is one run of one proxy mode, from its three processes.
type proxyRun struct {
	Mode       string `json:"mode"`
	Round      int    `json:"round"`
	Seq        int    `json:"seq"`
	LoadPID    int    `json:"load_pid"`
	FrontPID   int    `json:"front_pid"`
	MembersPID int    `json:"members_pid"`
	loadFigures
	// What the front's and the members' processes served over their lives.
	FrontProcessRequests   int64                  `json:"front_process_requests"`
	MembersProcessRequests int64                  `json:"members_process_requests"`
	FrontCPUSeconds        float64                `json:"front_cpu_seconds"`
	FrontCPUPerRequestUs   float64                `json:"front_cpu_per_request_us"`
	FrontPeakHeapBytes     uint64                 `json:"front_peak_heap_bytes"`
	FrontMaxRSSBytes       int64                  `json:"front_max_rss_bytes"`
	MembersCPUSeconds      float64                `json:"members_cpu_seconds"`
	MembersCPUPerRequestUs float64                `json:"members_cpu_per_request_us"`
	Members                []memberResult         `json:"members"`
	Pool                   *sharedtransport.Stats `json:"pool_stats,omitempty"`
	// The CONNECT proxy's counts over the load, when a member is behind it.
	ConnectProxy *connectproxy.Stats `json:"connect_proxy,omitempty"`
	// The pool's own view of each member (pool modes), and the scrape of
	// its collector (--scrape), both taken in the front's process after the
	// load.
	PoolView []poolMember `json:"pool_view,omitempty"`
	Scrape   string       `json:"scrape,omitempty"`
}

func (r *proxyRun) total(f func(memberResult) float64) float64 {
	t := 0.0
	for _, m := range r.Members {
		t += f(m)
	}
	return t
}

type proxyModeSummary struct {
	Mode                   string   `json:"mode"`
	Description            string   `json:"description"`
	Runs                   int      `json:"runs"`
	Requests               figure   `json:"requests"`
	Errors                 int64    `json:"errors"`
	FirstError             string   `json:"first_error,omitempty"`
	MemberConns            []figure `json:"member_connections"`
	Accepted               figure   `json:"connections_accepted"`
	FullHandshakes         figure   `json:"full_handshakes"`
	Resumed                figure   `json:"resumed_handshakes"`
	OpenAtEnd              figure   `json:"open_at_end"`
	ProxyTunnels           *figure  `json:"proxy_tunnels,omitempty"`
	ProxyRejected          *figure  `json:"proxy_rejected,omitempty"`
	RequestsPerSecond      figure   `json:"requests_per_second"`
	P50ms                  figure   `json:"p50_ms"`
	P99ms                  figure   `json:"p99_ms"`
	FrontCPUPerRequestUs   figure   `json:"front_cpu_per_request_us"`
	MembersCPUPerRequestUs figure   `json:"members_cpu_per_request_us"`
	FrontPeakHeapMiB       figure   `json:"front_peak_heap_mib"`
	FrontMaxRSSMiB         figure   `json:"front_max_rss_mib"`
	// Runs whose pool view agrees with the member servers' and the CONNECT
	// proxy's counts, of the runs with a pool.
	PoolViewAgrees int `json:"pool_view_agrees,omitempty"`
	PoolViewRuns   int `json:"pool_view_runs,omitempty"`
}

type proxyReport struct {
	Members  int                 `json:"members"`
	Auth     []string            `json:"member_auth"`
	Workers  int                 `json:"workers"`
	Requests int                 `json:"requests_per_worker"`
	Repeat   int                 `json:"repeat"`
	Started  string              `json:"started"`
	Modes    []*proxyModeSummary `json:"modes"`
	Runs     []*proxyRun         `json:"runs"`
}

func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseProxyFlags(args, stderr)
	if err != nil {
		return err
	}
	rep := &proxyReport{Members: o.members, Workers: o.workers, Requests: o.requests, Repeat: o.repeat,
		Started: time.Now().UTC().Format(time.RFC3339)}
	names, rounds := runOrder(o.modes, o.repeat)
	for i, name := range names {
		res, err := runProxyOnce(ctx, o, name, rounds[i], i+1, stderr)
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if err != nil {
			return fmt.Errorf("mode %s, round %d: %w", name, rounds[i], err)
		}
		rep.Runs = append(rep.Runs, res)
		rep.Auth = nil
		for _, m := range res.Members {
			rep.Auth = append(rep.Auth, m.Name+": "+m.Auth)
		}
	}
	rep.summarize(o.modes)
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	rep.writeTable(stdout)
	return nil
}

// runProxyOnce runs one proxy mode once, in fresh member, front and load
// processes.
func runProxyOnce(ctx context.Context, o *proxyOptions, name string, round, seq int, stderr io.Writer) (*proxyRun, error) {
	var mr membersReady
	members, err := startChild(ctx, "members", membersSpec{Members: o.members}, &mr, stderr)
	if err != nil {
		return nil, err
	}
	defer members.Close()
	var fr frontReady
	front, err := startChild(ctx, "front", frontSpec{Mode: name, Clusters: mr.Clusters, Metrics: o.scrape}, &fr, stderr)
	if err != nil {
		return nil, err
	}
	defer front.Close()
	spec := proxyLoadSpec{FrontURL: fr.URL, Workers: o.workers, Requests: o.requests, Timeout: o.timeout}
	for _, cl := range mr.Clusters {
		spec.Members = append(spec.Members, cl.Name)
	}
	if o.progress {
		spec.Label = fmt.Sprintf("round %d/%d %-30s", round, o.repeat, name)
	}
	var lr proxyLoadReady
	load, err := startChild(ctx, "proxy-load", spec, &lr, stderr)
	if err != nil {
		return nil, err
	}
	defer load.Close()

	if err := members.Call(ctx, "reset", nil); err != nil {
		return nil, err
	}
	if err := front.Call(ctx, "begin", nil); err != nil {
		return nil, err
	}
	var res proxyLoadResult
	if err := load.Call(ctx, "run", &res); err != nil {
		return nil, err
	}
	var fres frontResult
	if err := front.Call(ctx, "end", &fres); err != nil {
		return nil, err
	}
	var scrape string
	if fr.MetricsURL != "" {
		if scrape, err = scrapeMetrics(ctx, fr.MetricsURL); err != nil {
			return nil, err
		}
	}
	var ms membersStats
	if err := members.Call(ctx, "stats", &ms); err != nil {
		return nil, err
	}
	r := newProxyRun(name, round, seq, mr, res, fres, ms)
	r.Scrape = scrape
	return r, nil
}

func newProxyRun(name string, round, seq int, mr membersReady, res proxyLoadResult, fres frontResult, ms membersStats) *proxyRun {
	r := &proxyRun{
		Mode: name, Round: round, Seq: seq,
		LoadPID: res.PID, FrontPID: fres.PID, MembersPID: ms.PID,
		loadFigures:            res.loadFigures,
		FrontProcessRequests:   fres.ProcessRequests,
		MembersProcessRequests: ms.ProcessRequests,
		FrontCPUSeconds:        fres.CPU.Seconds(),
		FrontPeakHeapBytes:     fres.PeakHeapBytes,
		FrontMaxRSSBytes:       fres.MaxRSSBytes,
		MembersCPUSeconds:      ms.CPU.Seconds(),
		Pool:                   fres.Pool,
		ConnectProxy:           ms.ConnectProxy,
	}
	if r.Requests > 0 {
		r.FrontCPUPerRequestUs = r.FrontCPUSeconds * 1e6 / float64(r.Requests)
		r.MembersCPUPerRequestUs = r.MembersCPUSeconds * 1e6 / float64(r.Requests)
	}
	for i, st := range ms.Servers {
		m := memberResult{Name: mr.Clusters[i].Name, Auth: mr.Auth[i], URL: mr.Clusters[i].APIEndpoint, ProxyURL: mr.Clusters[i].ProxyURL,
			Accepted: st.Accepted, Full: st.FullHandshakes, Resumed: st.ResumedHandshakes, OpenAtEnd: st.Open}
		if i < len(res.PerMember) {
			m.Requests = res.PerMember[i]
		}
		if mr.Clusters[i].ProxyURL != "" {
			n := ms.ProxyTunnels[i]
			m.ProxyTunnels = &n
		}
		r.Members = append(r.Members, m)
	}
	if fres.Identities != nil {
		r.PoolView = poolViewOf(fres.Identities, r.Members)
	}
	return r
}

func (r *proxyReport) summarize(modes []string) {
	r.Modes = nil
	for _, name := range modes {
		var runs []*proxyRun
		for _, run := range r.Runs {
			if run.Mode == name {
				runs = append(runs, run)
			}
		}
		fig := func(f func(*proxyRun) float64) figure {
			var vs []float64
			for _, run := range runs {
				vs = append(vs, f(run))
			}
			return figureOf(vs)
		}
		s := &proxyModeSummary{
			Mode:           name,
			Description:    findProxyMode(name).desc,
			Runs:           len(runs),
			Requests:       fig(func(r *proxyRun) float64 { return float64(r.Requests) }),
			Accepted:       fig(func(r *proxyRun) float64 { return r.total(func(m memberResult) float64 { return float64(m.Accepted) }) }),
			FullHandshakes: fig(func(r *proxyRun) float64 { return r.total(func(m memberResult) float64 { return float64(m.Full) }) }),
			Resumed:        fig(func(r *proxyRun) float64 { return r.total(func(m memberResult) float64 { return float64(m.Resumed) }) }),
			OpenAtEnd: fig(func(r *proxyRun) float64 {
				return r.total(func(m memberResult) float64 { return float64(m.OpenAtEnd) })
			}),
			RequestsPerSecond:      fig(func(r *proxyRun) float64 { return r.RequestsPerSecond }),
			P50ms:                  fig(func(r *proxyRun) float64 { return r.P50ms }),
			P99ms:                  fig(func(r *proxyRun) float64 { return r.P99ms }),
			FrontCPUPerRequestUs:   fig(func(r *proxyRun) float64 { return r.FrontCPUPerRequestUs }),
			MembersCPUPerRequestUs: fig(func(r *proxyRun) float64 { return r.MembersCPUPerRequestUs }),
			FrontPeakHeapMiB:       fig(func(r *proxyRun) float64 { return float64(r.FrontPeakHeapBytes) / mib }),
			FrontMaxRSSMiB:         fig(func(r *proxyRun) float64 { return float64(r.FrontMaxRSSBytes) / mib }),
		}
		for i := range r.Members {
			s.MemberConns = append(s.MemberConns, fig(func(r *proxyRun) float64 {
				if i < len(r.Members) {
					return float64(r.Members[i].Accepted)
				}
				return 0
			}))
		}
		if len(runs) > 0 && runs[0].ConnectProxy != nil {
			tunnels := fig(func(r *proxyRun) float64 { return float64(r.ConnectProxy.Tunnels) })
			rejected := fig(func(r *proxyRun) float64 { return float64(r.ConnectProxy.Rejected) })
			s.ProxyTunnels, s.ProxyRejected = &tunnels, &rejected
		}
		for _, run := range runs {
			s.Errors += run.Errors
			if s.FirstError == "" {
				s.FirstError = run.FirstError
			}
			if run.PoolView != nil {
				s.PoolViewRuns++
				if poolViewAgrees(run.PoolView) {
					s.PoolViewAgrees++
				}
			}
		}
		r.Modes = append(r.Modes, s)
	}
}

func (r *proxyReport) writeTable(w io.Writer) {
	fmt.Fprintf(w, "conncount proxy: %d clients x %d requests through a Karmada-style front (a rest.Config per request from the member's Secret) to %d members, list nodes\n",
		r.Workers, r.Requests, r.Members)
	fmt.Fprintf(w, "%d round(s), every run with fresh processes for the members, the front and the load; round r starts at the r-th mode of --modes\n", r.Repeat)
	if r.Repeat > 1 {
		fmt.Fprintf(w, "each figure: median [min-max] of the %d runs\n", r.Repeat)
	}

	fmt.Fprintln(w, "\nConnections (counted by the member servers)")
	header := []string{"mode", "requests", "errors"}
	for i := range r.Members {
		header = append(header, fmt.Sprintf("member-%d conns", i+1))
	}
	header = append(header, "conns", "full handshakes", "resumed", "open at end")
	proxied := len(r.Modes) > 0 && r.Modes[0].ProxyTunnels != nil
	if proxied {
		header = append(header, "proxy tunnels", "proxy 407s")
	}
	var rows [][]string
	for _, m := range r.Modes {
		row := []string{m.Mode, m.Requests.String(), fmt.Sprint(m.Errors)}
		for _, c := range m.MemberConns {
			row = append(row, c.String())
		}
		row = append(row, m.Accepted.String(), m.FullHandshakes.String(), m.Resumed.String(), m.OpenAtEnd.String())
		if proxied {
			row = append(row, m.ProxyTunnels.String(), m.ProxyRejected.String())
		}
		rows = append(rows, row)
	}
	table(w, header, rows)

	fmt.Fprintln(w, "\nCost")
	rows = nil
	for _, m := range r.Modes {
		rows = append(rows, []string{m.Mode, m.RequestsPerSecond.String(), m.P50ms.String(), m.P99ms.String(),
			m.FrontCPUPerRequestUs.String(), m.MembersCPUPerRequestUs.String(), m.FrontPeakHeapMiB.String(), m.FrontMaxRSSMiB.String()})
	}
	table(w, []string{"mode", "req/s", "p50 ms", "p99 ms", "front CPU µs/req", "members CPU µs/req", "front peak heap MiB", "front max RSS MiB"}, rows)

	fmt.Fprintln(w)
	fmt.Fprintln(w, "req/s, p50/p99: the load's process (clients of the front); CPU: getrusage of the front's and the members' processes over the load; heap: runtime/metrics "+heapMetric+" sampled every 20ms")
	for _, m := range r.Modes {
		fmt.Fprintf(w, "%-30s %s\n", m.Mode, m.Description)
		if m.FirstError != "" {
			fmt.Fprintf(w, "%-30s %d errors, first: %s\n", "", m.Errors, m.FirstError)
		}
	}
	if len(r.Auth) > 0 {
		fmt.Fprintf(w, "the front authenticates by: %s\n", strings.Join(r.Auth, "; "))
	}
	if proxied {
		fmt.Fprintln(w, "proxy tunnels, 407s: counted by the CONNECT proxy, which runs in the members' process (its CPU is in members CPU)")
	}
	r.writePoolView(w)
	r.writeScrapes(w)
}

// ---- the members' process ----

type membersSpec struct {
	Members int `json:"members"`
}

type membersReady struct {
	PID      int                   `json:"pid"`
	Clusters []memberproxy.Cluster `json:"clusters"`
	Auth     []string              `json:"auth"`
}

// behindProxy says whether member i (from 0) is reached through the CONNECT
// proxy: member-3, member-6, and so on.
func behindProxy(i int) bool { return i%3 == 2 }

// proxyCredential is the Proxy-Authorization value the CONNECT proxy wants
// from the front for the named member: each member has credentials of its
// own, as each Karmada cluster has its Spec.ProxyHeader.
func proxyCredential(name string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte("karmada-front:"+name+"-proxy-password"))
}

// membersRole serves the member servers and, when a member is behind one,
// the CONNECT proxy, in one process. Commands are serversRole's; "reset"
// zeroes the proxy's counts too, and "stats" adds them.
type membersRole struct {
	serversRole
	proxy   *connectproxy.Proxy
	targets []string // each member's host:port, the proxy's CONNECT target
}

type membersStats struct {
	serversStats
	ConnectProxy *connectproxy.Stats `json:"connect_proxy,omitempty"`
	// ProxyTunnels are the tunnels the proxy opened to each member.
	ProxyTunnels []uint64 `json:"proxy_tunnels,omitempty"`
}

func startMembersRole(specJSON []byte) (any, childRole, error) {
	var spec membersSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	r := &membersRole{}
	var creds []string
	for i := range spec.Members {
		if behindProxy(i) {
			creds = append(creds, proxyCredential(fmt.Sprintf("member-%d", i+1)))
		}
	}
	if len(creds) > 0 {
		var err error
		if r.proxy, err = connectproxy.Start(connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: creds}); err != nil {
			return nil, nil, err
		}
	}
	ready := membersReady{PID: os.Getpid()}
	for i := range spec.Members {
		srv, cl, auth, err := startMember(i, &r.serversRole)
		if err != nil {
			r.close()
			return nil, nil, err
		}
		if behindProxy(i) {
			cl.ProxyURL = r.proxy.URL()
			cl.ProxyHeader = http.Header{"Proxy-Authorization": {proxyCredential(cl.Name)}}
			auth += ", through a CONNECT proxy that requires Proxy-Authorization"
		}
		r.servers = append(r.servers, srv)
		r.targets = append(r.targets, srv.Addr())
		ready.Clusters = append(ready.Clusters, cl)
		ready.Auth = append(ready.Auth, auth)
	}
	return ready, r, nil
}

func (r *membersRole) handle(ctx context.Context, cmd string) (any, error) {
	if r.proxy != nil && cmd == "reset" {
		r.proxy.ResetStats()
	}
	v, err := r.serversRole.handle(ctx, cmd)
	if err != nil || cmd != "stats" {
		return v, err
	}
	st := membersStats{serversStats: v.(serversStats)}
	if r.proxy != nil {
		ps := r.proxy.Stats()
		st.ConnectProxy = &ps
		st.ProxyTunnels = make([]uint64, len(r.targets))
		for _, t := range r.proxy.Tunnels() {
			if i := slices.Index(r.targets, t.Target); i >= 0 {
				st.ProxyTunnels[i]++
			}
		}
	}
	return st, nil
}

func (r *membersRole) close() {
	if r.proxy != nil {
		_ = r.proxy.Close()
	}
	r.serversRole.close()
}

// startMember starts member i: an embedded API server with a CA of its own.
// The front authenticates to odd members by client certificate and to even
// ones by bearer token, as Karmada's clusters do by their Secrets.
func startMember(i int, r *serversRole) (*testserver.Server, memberproxy.Cluster, string, error) {
	name := fmt.Sprintf("member-%d", i+1)
	ca, err := testserver.NewCA(name + "-ca")
	if err != nil {
		return nil, memberproxy.Cluster{}, "", err
	}
	token := name + "-token"
	srv, err := testserver.Start(r.options(testserver.Options{
		CA:         ca,
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{token: "karmada-front"},
	}))
	if err != nil {
		return nil, memberproxy.Cluster{}, "", err
	}
	cl := memberproxy.Cluster{Name: name, APIEndpoint: srv.URL(), Secret: memberproxy.Secret{CAData: ca.CertPEM()}}
	auth := "token"
	if i%2 == 0 {
		kp, err := ca.IssueClient("karmada-front")
		if err != nil {
			srv.Close()
			return nil, memberproxy.Cluster{}, "", err
		}
		cl.Secret.CertData, cl.Secret.KeyData = kp.CertPEM, kp.KeyPEM
		auth = "client certificate"
	} else {
		cl.Secret.Token = token
	}
	return srv, cl, auth, nil
}

// ---- the front's process ----

type frontSpec struct {
	Mode     string                `json:"mode"`
	Clusters []memberproxy.Cluster `json:"clusters"`
	// Metrics serves the pool's collector (pool modes).
	Metrics bool `json:"metrics,omitempty"`
}

type frontReady struct {
	PID        int    `json:"pid"`
	URL        string `json:"url"`
	MetricsURL string `json:"metrics_url,omitempty"`
}

// frontResult is what the front's process measured over the load.
type frontResult struct {
	PID             int                    `json:"pid"`
	ProcessRequests int64                  `json:"process_requests"`
	CPU             time.Duration          `json:"cpu_ns"`
	PeakHeapBytes   uint64                 `json:"peak_heap_bytes"`
	MaxRSSBytes     int64                  `json:"max_rss_bytes"`
	Pool            *sharedtransport.Stats `json:"pool_stats,omitempty"`
	// Identities is the pool's snapshot, taken after the CPU time.
	Identities []sharedtransport.IdentityInfo `json:"pool_identities,omitempty"`
}

// frontRole serves the front on a loopback port, and with frontSpec.Metrics
// the pool's collector on another. Commands: "begin" starts the CPU clock
// and the heap sampler, "end" answers a frontResult.
type frontRole struct {
	srv     *http.Server
	metrics *http.Server
	pool    *sharedtransport.Pool
	served  atomic.Int64
	cpu0    time.Duration
	heap    *heapSampler
}

func startFrontRole(specJSON []byte) (any, childRole, error) {
	var spec frontSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	def := findProxyMode(spec.Mode)
	if def == nil {
		return nil, nil, fmt.Errorf("unknown proxy mode %q", spec.Mode)
	}
	clusters := memberproxy.NewClusters()
	for _, cl := range spec.Clusters {
		clusters.Set(cl)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	r := &frontRole{}
	var front *memberproxy.Front
	front, r.pool = def.newFront(clusters)
	r.srv = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			r.served.Add(1)
			front.ServeHTTP(w, req)
		}),
		ReadHeaderTimeout: 30 * time.Second,
	}
	go func() { _ = r.srv.Serve(ln) }()
	ready := frontReady{PID: os.Getpid(), URL: "http://" + ln.Addr().String()}
	if spec.Metrics && r.pool != nil {
		if r.metrics, ready.MetricsURL, err = serveMetrics(r.pool); err != nil {
			r.close()
			return nil, nil, err
		}
	}
	return ready, r, nil
}

func (r *frontRole) handle(_ context.Context, cmd string) (any, error) {
	switch cmd {
	case "begin":
		r.cpu0 = selfUsage().CPU
		r.heap = startHeapSampler(20 * time.Millisecond)
		return nil, nil
	case "end":
		if r.heap == nil {
			return nil, errors.New("end before begin")
		}
		u := selfUsage()
		res := frontResult{PID: os.Getpid(), ProcessRequests: r.served.Load(), CPU: u.CPU - r.cpu0,
			PeakHeapBytes: r.heap.Stop(), MaxRSSBytes: u.MaxRSSKiB * 1024}
		r.heap = nil
		if r.pool != nil {
			st := r.pool.Stats()
			res.Pool = &st
			res.Identities = r.pool.Identities()
		}
		return res, nil
	}
	return nil, fmt.Errorf("unknown command %q", cmd)
}

func (r *frontRole) close() {
	if r.metrics != nil {
		_ = r.metrics.Close()
	}
	_ = r.srv.Close()
	if r.pool != nil {
		_ = r.pool.Close()
	}
}

// ---- the load's process ----

type proxyLoadSpec struct {
	FrontURL string        `json:"front_url"`
	Members  []string      `json:"members"`
	Workers  int           `json:"workers"`
	Requests int           `json:"requests"`
	Timeout  time.Duration `json:"timeout"`
	Label    string        `json:"label,omitempty"`
}

type proxyLoadReady struct {
	PID int `json:"pid"`
}

type proxyLoadResult struct {
	PID       int     `json:"pid"`
	PerMember []int64 `json:"per_member"`
	loadFigures
}

type proxyLoadRole struct {
	spec proxyLoadSpec
	ran  bool
}

func startProxyLoadRole(specJSON []byte) (any, childRole, error) {
	var spec proxyLoadSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	if len(spec.Members) == 0 {
		return nil, nil, errors.New("no members")
	}
	return proxyLoadReady{PID: os.Getpid()}, &proxyLoadRole{spec: spec}, nil
}

func (l *proxyLoadRole) close() {}

// handle runs the load on "run", once.
func (l *proxyLoadRole) handle(ctx context.Context, cmd string) (any, error) {
	if cmd != "run" {
		return nil, fmt.Errorf("unknown command %q", cmd)
	}
	if l.ran {
		return nil, errors.New("a load process runs its load once")
	}
	l.ran = true
	o := &l.spec
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: o.Workers}, Timeout: o.Timeout}
	defer client.CloseIdleConnections()
	var done, failed atomic.Int64
	var firstErr atomic.Value
	perMember := make([]atomic.Int64, len(o.Members))
	lat := make([][]time.Duration, o.Workers)
	var progress *progressLine
	if o.Label != "" {
		progress = newProgressLine(os.Stderr)
	}
	start := time.Now()
	show := func(final bool) {
		progress.show(fmt.Sprintf("%s %6d/%d requests  %d errors  %5.1fs",
			o.Label, done.Load(), o.Workers*o.Requests, failed.Load(), time.Since(start).Seconds()), final)
	}
	var wg sync.WaitGroup
	for w := range o.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range o.Requests {
				if ctx.Err() != nil {
					return
				}
				m := (w*o.Requests + i) % len(o.Members)
				t0 := time.Now()
				err := listThroughFront(ctx, client, o.FrontURL, o.Members[m])
				lat[w] = append(lat[w], time.Since(t0))
				perMember[m].Add(1)
				if done.Add(1); err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
				if w == 0 {
					show(false)
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	show(true)
	res := proxyLoadResult{PID: os.Getpid(), loadFigures: loadFigures{Requests: done.Load(), Errors: failed.Load(), Seconds: elapsed.Seconds()}}
	if s, ok := firstErr.Load().(string); ok {
		res.FirstError = s
	}
	for i := range perMember {
		res.PerMember = append(res.PerMember, perMember[i].Load())
	}
	if res.Requests > 0 {
		res.RequestsPerSecond = float64(res.Requests) / elapsed.Seconds()
	}
	res.P50ms, res.P99ms = latencyPercentiles(lat)
	return res, nil
}

func listThroughFront(ctx context.Context, client *http.Client, frontURL, cluster string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, frontURL+memberproxy.PathPrefix+cluster+"/proxy/api/v1/nodes", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", cluster, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
