package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// unknown marks a count a target cannot observe.
const unknown = -1

// serverCounts are what a target observed over one run's load. A count is
// unknown (-1) when the target cannot observe it.
type serverCounts struct {
	Accepted       int64
	PeakOpen       int64
	Open           int64
	FullHandshakes int64
	Resumed        int64
	// The server's process, when it runs one of its own for the run: its
	// PID, the requests it served over its life, its CPU time over the load
	// and its largest resident set.
	PID             int
	ProcessRequests int64
	CPU             time.Duration
	MaxRSSKiB       int64
}

// A target is what the load runs against, and where connections are counted.
type target interface {
	Describe() string
	// Sources tells, per column, where the numbers come from.
	Sources() map[string]string
	// start prepares one run (for the embedded server, a fresh server
	// process); the mode's client process is started after it.
	start(ctx context.Context, stderr io.Writer) (targetRun, error)
	// sampledPeak says whether the peak of open connections comes from
	// sampling open; the embedded server keeps its own.
	sampledPeak() bool
	close()
}

// A targetRun counts one run's connections.
type targetRun interface {
	// kubeconfig is the file the client process loads.
	kubeconfig() string
	// begin zeroes the counts just before the load starts in the client
	// process clientPID.
	begin(ctx context.Context, clientPID int) error
	// open is the number of connections open now, cheap enough to sample.
	open(ctx context.Context) (int, error)
	// end takes the counts after the load, while the client still runs.
	end(ctx context.Context) (serverCounts, error)
	close()
}

func loadKubeconfig(path string) (*rest.Config, error) {
	if _, err := os.ReadFile(path); err != nil {
		return nil, fmt.Errorf("cannot read kubeconfig %s: %w", path, err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return cfg, nil
}

// ---- embedded server ----

// embeddedTarget starts a fresh embedded server process for every run, so
// that the server's CPU time and memory are the run's alone too.
type embeddedTarget struct {
	dir string // kubeconfigs of the runs' servers
}

func newEmbeddedTarget() (target, error) {
	dir, err := os.MkdirTemp("", "conncount-")
	if err != nil {
		return nil, err
	}
	return &embeddedTarget{dir: dir}, nil
}

func (t *embeddedTarget) Describe() string {
	return "embedded server in a child process, a fresh one per run (HTTP/2, 100 streams per connection, client-certificate auth)"
}

func (t *embeddedTarget) Sources() map[string]string {
	s := "embedded server (its own process): connections from its ConnState hook, handshakes from its TLS VerifyConnection hook"
	return map[string]string{
		"accepted":   s,
		"peak_open":  s,
		"open_end":   s,
		"handshakes": s,
		"cpu":        "getrusage(RUSAGE_SELF) of the mode's client process, over the load",
		"server_cpu": "getrusage(RUSAGE_SELF) of the embedded server's process, over the load",
		"memory":     "the client process: peak heap from runtime/metrics " + heapMetric + " sampled every 20ms, max RSS from getrusage",
		"latency":    "client side, per request: fresh rest.Config + clientset + list",
	}
}

func (t *embeddedTarget) start(ctx context.Context, stderr io.Writer) (targetRun, error) {
	r := &embeddedRun{}
	var err error
	r.child, err = startChild(ctx, "server", serverSpec{Dir: t.dir}, &r.ready, stderr)
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (t *embeddedTarget) sampledPeak() bool { return false }
func (t *embeddedTarget) close()            { os.RemoveAll(t.dir) }

type embeddedRun struct {
	child *child
	ready serverReady
}

func (r *embeddedRun) kubeconfig() string { return r.ready.Kubeconfig }
func (r *embeddedRun) begin(ctx context.Context, _ int) error {
	return r.child.Call(ctx, "reset", nil)
}
func (r *embeddedRun) open(ctx context.Context) (int, error) {
	var n int
	err := r.child.Call(ctx, "open", &n)
	return n, err
}
func (r *embeddedRun) end(ctx context.Context) (serverCounts, error) {
	var st serversStats
	if err := r.child.Call(ctx, "stats", &st); err != nil {
		return serverCounts{}, err
	}
	s := st.Servers[0]
	return serverCounts{
		Accepted:        int64(s.Accepted),
		PeakOpen:        int64(s.PeakOpen),
		Open:            int64(s.Open),
		FullHandshakes:  int64(s.FullHandshakes),
		Resumed:         int64(s.ResumedHandshakes),
		PID:             st.PID,
		ProcessRequests: st.ProcessRequests,
		CPU:             st.CPU,
		MaxRSSKiB:       st.MaxRSSKiB,
	}, nil
}
func (r *embeddedRun) close() { _ = r.child.Close() }

// serversRole is a child process serving one or more embedded API servers
// (the main command's server, the proxy's members). Commands: "reset"
// zeroes the counters and starts the CPU clock, "open" answers the open
// connections, "stats" the counters.
type serversRole struct {
	servers []*testserver.Server
	served  atomic.Int64 // requests served over the process's life
	cpu0    time.Duration
	dir     string
}

type serversStats struct {
	PID             int                `json:"pid"`
	Servers         []testserver.Stats `json:"servers"`
	ProcessRequests int64              `json:"process_requests"`
	CPU             time.Duration      `json:"cpu_ns"`
	MaxRSSKiB       int64              `json:"max_rss_kib"`
}

// options returns testserver options that count the requests served.
func (r *serversRole) options(o testserver.Options) testserver.Options {
	o.OnRequest = func(testserver.RequestInfo) { r.served.Add(1) }
	return o
}

func (r *serversRole) handle(_ context.Context, cmd string) (any, error) {
	switch cmd {
	case "reset":
		for _, s := range r.servers {
			s.ResetStats()
		}
		r.cpu0 = selfUsage().CPU
		return nil, nil
	case "open":
		n := 0
		for _, s := range r.servers {
			n += s.OpenConns()
		}
		return n, nil
	case "stats":
		u := selfUsage()
		st := serversStats{PID: os.Getpid(), ProcessRequests: r.served.Load(), CPU: u.CPU - r.cpu0, MaxRSSKiB: u.MaxRSSKiB}
		for _, s := range r.servers {
			st.Servers = append(st.Servers, s.Stats())
		}
		return st, nil
	}
	return nil, fmt.Errorf("unknown command %q", cmd)
}

func (r *serversRole) close() {
	for _, s := range r.servers {
		s.Close()
	}
	if r.dir != "" {
		os.RemoveAll(r.dir)
	}
}

type serverSpec struct {
	Dir string `json:"dir"`
}

type serverReady struct {
	Kubeconfig string `json:"kubeconfig"`
	URL        string `json:"url"`
	PID        int    `json:"pid"`
}

// startServerRole starts the test server with a client certificate for
// "conncount" and writes a file-based kubeconfig (certificate, key and CA
// as files, as most kubeconfigs on disk are) into a new directory in
// spec.Dir.
func startServerRole(specJSON []byte) (any, childRole, error) {
	var spec serverSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	r := &serversRole{}
	dir, err := os.MkdirTemp(spec.Dir, "server-")
	if err != nil {
		return nil, nil, err
	}
	r.dir = dir
	srv, err := testserver.Start(r.options(testserver.Options{}))
	if err != nil {
		r.close()
		return nil, nil, err
	}
	r.servers = append(r.servers, srv)
	kp, err := srv.CA().IssueClient("conncount", "system:masters")
	if err != nil {
		r.close()
		return nil, nil, err
	}
	p, err := srv.WriteKubeconfig(filepath.Join(dir, "kubeconfig"), kp, false)
	if err != nil {
		r.close()
		return nil, nil, err
	}
	return serverReady{Kubeconfig: p.Kubeconfig, URL: srv.URL(), PID: os.Getpid()}, r, nil
}

// ---- real cluster ----

// clusterTarget counts the client process's sockets to the API server in
// the kernel's tables.
type clusterTarget struct {
	cfg       *rest.Config
	path      string
	host      string
	port      int
	ips       map[string]bool
	proxyNote string
}

func newClusterTarget(path string) (*clusterTarget, error) {
	cfg, err := loadKubeconfig(path)
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(cfg.Host)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("kubeconfig %s: server %q is not a URL", path, cfg.Host)
	}
	host, portStr := u.Hostname(), u.Port()
	if portStr == "" {
		portStr = "443"
		if u.Scheme == "http" {
			portStr = "80"
		}
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: server %q: bad port", path, cfg.Host)
	}
	t := &clusterTarget{cfg: cfg, path: path, host: host, port: port, ips: map[string]bool{}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return nil, fmt.Errorf("cannot reach API server %s: %w", cfg.Host, err)
	}
	for _, a := range addrs {
		t.ips[a.IP.String()] = true
		if v4 := a.IP.To4(); v4 != nil {
			t.ips[v4.String()] = true
		}
	}
	if os.Getenv("HTTPS_PROXY") != "" || os.Getenv("https_proxy") != "" {
		t.proxyNote = " (HTTPS_PROXY is set: sockets to a proxy are not counted)"
	}
	if _, err := readActiveOpens(); err != nil {
		return nil, fmt.Errorf("counting connections needs Linux /proc: %w", err)
	}
	return t, nil
}

func (t *clusterTarget) Describe() string {
	return fmt.Sprintf("cluster %s from kubeconfig %s%s", t.cfg.Host, t.path, t.proxyNote)
}

func (t *clusterTarget) Sources() map[string]string {
	return map[string]string{
		"accepted":   "kernel: Tcp ActiveOpens delta in /proc/net/snmp (every connection this network namespace opened)",
		"peak_open":  "kernel: ESTABLISHED sockets of the mode's client process to the server's address and port in /proc/PID/net/tcp and tcp6, sampled",
		"open_end":   "kernel: ESTABLISHED sockets of the mode's client process to the server, at the end of the load",
		"handshakes": "sharedtransport modes: the library's Stats; client-go modes: inferred, one full handshake per connection (client-go sets no TLS session cache)",
		"cpu":        "getrusage(RUSAGE_SELF) of the mode's client process, over the load",
		"memory":     "the client process: peak heap from runtime/metrics " + heapMetric + " sampled every 20ms, max RSS from getrusage",
		"latency":    "client side, per request: fresh rest.Config + clientset + list",
	}
}

func (t *clusterTarget) start(context.Context, io.Writer) (targetRun, error) {
	return &clusterRun{t: t}, nil
}

func (t *clusterTarget) sampledPeak() bool { return true }
func (t *clusterTarget) close()            {}

type clusterRun struct {
	t      *clusterTarget
	pid    int
	opens0 int64
	peak   atomic.Int64 // open runs on the sampler goroutine too
}

func (r *clusterRun) kubeconfig() string { return r.t.path }

func (r *clusterRun) begin(ctx context.Context, clientPID int) error {
	r.pid = clientPID
	n, err := readActiveOpens()
	if err != nil {
		return err
	}
	r.opens0 = n
	open, err := r.open(ctx)
	if err != nil {
		return err
	}
	r.peak.Store(int64(open))
	return nil
}

func (r *clusterRun) open(context.Context) (int, error) {
	n, err := countSockets(r.pid, r.t.ips, r.t.port)
	for err == nil {
		p := r.peak.Load()
		if int64(n) <= p || r.peak.CompareAndSwap(p, int64(n)) {
			break
		}
	}
	return n, err
}

func (r *clusterRun) end(ctx context.Context) (serverCounts, error) {
	n, err := readActiveOpens()
	if err != nil {
		return serverCounts{}, err
	}
	open, err := r.open(ctx)
	if err != nil {
		return serverCounts{}, err
	}
	return serverCounts{
		Accepted: n - r.opens0, PeakOpen: r.peak.Load(), Open: int64(open),
		FullHandshakes: unknown, Resumed: unknown, ProcessRequests: unknown, CPU: unknown,
	}, nil
}

func (r *clusterRun) close() {}

// readActiveOpens returns the kernel's Tcp ActiveOpens counter.
func readActiveOpens() (int64, error) {
	b, err := os.ReadFile("/proc/net/snmp")
	if err != nil {
		return 0, err
	}
	var header []string
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "Tcp:") {
			continue
		}
		fields := strings.Fields(line)
		if header == nil {
			header = fields
			continue
		}
		for i, name := range header {
			if name == "ActiveOpens" && i < len(fields) {
				return strconv.ParseInt(fields[i], 10, 64)
			}
		}
	}
	return 0, errors.New("/proc/net/snmp has no Tcp ActiveOpens")
}
