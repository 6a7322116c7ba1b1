package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
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

// counts are what a target observed since its last Reset. A field is
// unknown (-1) when the target cannot observe it.
type counts struct {
	Accepted       int64
	PeakOpen       int64
	Open           int64
	FullHandshakes int64
	Resumed        int64
}

// A target is what the load runs against, and where connections are counted.
type target interface {
	// Config is the rest.Config loaded from the target's kubeconfig; callers
	// copy it.
	Config() *rest.Config
	Describe() string
	// Sources tells, per column, where the numbers come from.
	Sources() map[string]string
	Reset() error
	Open() (int, error)
	Counts() (counts, error)
	// Settle waits up to d for the previous mode's connections to close.
	Settle(ctx context.Context, d time.Duration) error
	Close()
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

const envEmbedded = "CONNCOUNT_EMBEDDED_SERVER_DIR"

// startEmbedded starts the test server with a client certificate for
// "conncount" and writes a file-based kubeconfig (certificate, key and CA
// as files, as most kubeconfigs on disk are) into dir.
func startEmbedded(dir string) (*testserver.Server, string, error) {
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		return nil, "", err
	}
	kp, err := srv.CA().IssueClient("conncount", "system:masters")
	if err != nil {
		srv.Close()
		return nil, "", err
	}
	p, err := srv.WriteKubeconfig(filepath.Join(dir, "kubeconfig"), kp, false)
	if err != nil {
		srv.Close()
		return nil, "", err
	}
	return srv, p.Kubeconfig, nil
}

func embeddedSources(where string) map[string]string {
	s := "embedded server (" + where + "): connections from its ConnState hook, handshakes from its TLS VerifyConnection hook"
	return map[string]string{
		"accepted":   s,
		"peak_open":  s,
		"open_end":   s,
		"handshakes": s,
		"cpu":        "getrusage(RUSAGE_SELF) of the client process",
		"latency":    "client side, per request: fresh rest.Config + clientset + list",
	}
}

func countsOf(st testserver.Stats) counts {
	return counts{
		Accepted:       int64(st.Accepted),
		PeakOpen:       int64(st.PeakOpen),
		Open:           int64(st.Open),
		FullHandshakes: int64(st.FullHandshakes),
		Resumed:        int64(st.ResumedHandshakes),
	}
}

// inProcessTarget runs the server in this process.
type inProcessTarget struct {
	srv *testserver.Server
	cfg *rest.Config
	dir string
}

func newInProcessTarget() (target, error) {
	dir, err := os.MkdirTemp("", "conncount-")
	if err != nil {
		return nil, err
	}
	srv, kc, err := startEmbedded(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	cfg, err := loadKubeconfig(kc)
	if err != nil {
		srv.Close()
		os.RemoveAll(dir)
		return nil, err
	}
	return &inProcessTarget{srv: srv, cfg: cfg, dir: dir}, nil
}

func (t *inProcessTarget) Config() *rest.Config { return t.cfg }
func (t *inProcessTarget) Describe() string {
	return "embedded server " + t.srv.URL() + " in this process (HTTP/2, 100 streams per connection, client-certificate auth)"
}
func (t *inProcessTarget) Sources() map[string]string {
	s := embeddedSources("in this process")
	s["cpu"] = "getrusage(RUSAGE_SELF): client AND embedded server (--embedded-in-process)"
	return s
}
func (t *inProcessTarget) Reset() error            { t.srv.ResetStats(); return nil }
func (t *inProcessTarget) Open() (int, error)      { return t.srv.OpenConns(), nil }
func (t *inProcessTarget) Counts() (counts, error) { return countsOf(t.srv.Stats()), nil }
func (t *inProcessTarget) Settle(ctx context.Context, d time.Duration) error {
	if waitClosed(ctx, t, d) {
		return nil
	}
	return t.srv.Restart()
}
func (t *inProcessTarget) Close() {
	t.srv.Close()
	os.RemoveAll(t.dir)
}

// waitClosed polls until the target has no open connection or d passes.
func waitClosed(ctx context.Context, t target, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		n, err := t.Open()
		if err == nil && n == 0 {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// childTarget runs the server in a child process (this executable again,
// with envEmbedded set), so that getrusage of this process is the client's
// CPU alone. The child is controlled over a plain-HTTP loopback port of its
// own, which the counts do not include.
type childTarget struct {
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	cfg     *rest.Config
	url     string
	control string
	client  *http.Client
	dir     string
}

type childReady struct {
	Kubeconfig string `json:"kubeconfig"`
	URL        string `json:"url"`
	Control    string `json:"control"`
	Error      string `json:"error,omitempty"`
}

func newChildTarget(ctx context.Context) (target, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "conncount-")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), envEmbedded+"="+dir)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start embedded server: %w", err)
	}
	t := &childTarget{cmd: cmd, stdin: stdin, dir: dir,
		client: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 4}}}
	readyc := make(chan childReady, 1)
	go func() {
		var r childReady
		line, err := bufio.NewReader(stdout).ReadBytes('\n')
		if err == nil {
			err = json.Unmarshal(line, &r)
		}
		if err != nil && r.Error == "" {
			r.Error = "no ready line from the embedded server: " + err.Error()
		}
		readyc <- r
		_, _ = io.Copy(io.Discard, stdout)
	}()
	var ready childReady
	select {
	case ready = <-readyc:
	case <-time.After(30 * time.Second):
		ready.Error = "embedded server did not start within 30s"
	case <-ctx.Done():
		ready.Error = ctx.Err().Error()
	}
	if ready.Error != "" {
		t.Close()
		return nil, errors.New(ready.Error)
	}
	t.url, t.control = ready.URL, ready.Control
	if t.cfg, err = loadKubeconfig(ready.Kubeconfig); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

func (t *childTarget) Config() *rest.Config { return t.cfg }
func (t *childTarget) Describe() string {
	return "embedded server " + t.url + " in a child process (HTTP/2, 100 streams per connection, client-certificate auth)"
}
func (t *childTarget) Sources() map[string]string { return embeddedSources("child process") }

func (t *childTarget) call(method, path string, out any) error {
	req, err := http.NewRequest(method, t.control+path, nil)
	if err != nil {
		return err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return fmt.Errorf("embedded server control: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("embedded server control %s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

func (t *childTarget) Reset() error { return t.call(http.MethodPost, "/reset", nil) }
func (t *childTarget) Open() (int, error) {
	var n int
	err := t.call(http.MethodGet, "/open", &n)
	return n, err
}
func (t *childTarget) Counts() (counts, error) {
	var st testserver.Stats
	if err := t.call(http.MethodGet, "/stats", &st); err != nil {
		return counts{}, err
	}
	return countsOf(st), nil
}
func (t *childTarget) Settle(ctx context.Context, d time.Duration) error {
	if waitClosed(ctx, t, d) {
		return nil
	}
	return t.call(http.MethodPost, "/restart", nil)
}
func (t *childTarget) Close() {
	_ = t.stdin.Close() // the child exits when its stdin closes
	done := make(chan struct{})
	go func() { _ = t.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = t.cmd.Process.Kill()
		<-done
	}
	t.client.CloseIdleConnections()
	os.RemoveAll(t.dir)
}

// serveEmbedded is the child process: it serves until stdin closes.
func serveEmbedded(dir string, stdin io.Reader, stdout io.Writer) int {
	fail := func(err error) int {
		b, _ := json.Marshal(childReady{Error: err.Error()})
		fmt.Fprintf(stdout, "%s\n", b)
		return 1
	}
	srv, kc, err := startEmbedded(dir)
	if err != nil {
		return fail(err)
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(srv.Stats())
	})
	mux.HandleFunc("GET /open", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, srv.OpenConns())
	})
	mux.HandleFunc("POST /reset", func(w http.ResponseWriter, r *http.Request) { srv.ResetStats() })
	mux.HandleFunc("POST /restart", func(w http.ResponseWriter, r *http.Request) {
		if err := srv.Restart(); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
		}
	})
	ctl := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = ctl.Serve(ln) }()
	defer ctl.Close()
	b, _ := json.Marshal(childReady{Kubeconfig: kc, URL: srv.URL(), Control: "http://" + ln.Addr().String()})
	fmt.Fprintf(stdout, "%s\n", b)
	_, _ = io.Copy(io.Discard, stdin) // until the parent closes stdin or exits
	return 0
}

// ---- real cluster ----

// clusterTarget counts this process's sockets to the API server in the
// kernel's tables.
type clusterTarget struct {
	cfg       *rest.Config
	path      string
	host      string
	port      int
	ips       map[string]bool
	opens0    int64
	peak      atomic.Int64 // Open runs on the sampler goroutine too
	proxyNote string
}

func newClusterTarget(path string) (target, error) {
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

func (t *clusterTarget) Config() *rest.Config { return t.cfg }
func (t *clusterTarget) Describe() string {
	return fmt.Sprintf("cluster %s from kubeconfig %s%s", t.cfg.Host, t.path, t.proxyNote)
}
func (t *clusterTarget) Sources() map[string]string {
	return map[string]string{
		"accepted":   "kernel: Tcp ActiveOpens delta in /proc/net/snmp (every connection this network namespace opened)",
		"peak_open":  "kernel: ESTABLISHED sockets of this process to the server's address and port in /proc/net/tcp and tcp6, sampled",
		"open_end":   "kernel: ESTABLISHED sockets of this process to the server, at the end of the mode",
		"handshakes": "sharedtransport modes: the library's Stats; client-go modes: inferred, one full handshake per connection (client-go sets no TLS session cache)",
		"cpu":        "getrusage(RUSAGE_SELF) of this process",
		"latency":    "client side, per request: fresh rest.Config + clientset + list",
	}
}

func (t *clusterTarget) Reset() error {
	n, err := readActiveOpens()
	if err != nil {
		return err
	}
	t.opens0 = n
	open, err := t.Open()
	if err != nil {
		return err
	}
	t.peak.Store(int64(open))
	return nil
}

func (t *clusterTarget) Open() (int, error) {
	n, err := countSockets(t.ips, t.port)
	for err == nil {
		p := t.peak.Load()
		if int64(n) <= p || t.peak.CompareAndSwap(p, int64(n)) {
			break
		}
	}
	return n, err
}

func (t *clusterTarget) Counts() (counts, error) {
	n, err := readActiveOpens()
	if err != nil {
		return counts{}, err
	}
	open, err := t.Open()
	if err != nil {
		return counts{}, err
	}
	return counts{Accepted: n - t.opens0, PeakOpen: t.peak.Load(), Open: int64(open), FullHandshakes: unknown, Resumed: unknown}, nil
}

func (t *clusterTarget) Settle(ctx context.Context, d time.Duration) error {
	if waitClosed(ctx, t, d) {
		return nil
	}
	n, _ := t.Open()
	return fmt.Errorf("%d connections of the previous mode are still open after %v; the next mode's open counts include them", n, d)
}

func (t *clusterTarget) Close() {}

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
