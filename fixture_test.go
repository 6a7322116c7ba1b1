package sharedtransport

// The fixture the package's tests share: an API server with client
// certificate auth that counts its connections, kubeconfigs, certificate
// files written the way the real writers write them, relays and CONNECT
// proxies that count connections, and the load loops.

import (
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// fixture is a TLS server with HTTP/2 (100 streams), client-certificate
// auth and server-side connection counting, plus client certificates.
type fixture struct {
	srv               *testserver.Server
	ca                *testserver.CA
	alice, bob, carol *testserver.KeyPair
	dir               string
}

func newFixture(t testing.TB, opts testserver.Options) *fixture {
	t.Helper()
	ca, err := testserver.NewCA("test-ca")
	must(t, err)
	opts.CA = ca
	srv, err := testserver.Start(opts)
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	f := &fixture{srv: srv, ca: ca, dir: t.TempDir()}
	for _, p := range []struct {
		kp   **testserver.KeyPair
		name string
	}{{&f.alice, "alice"}, {&f.bob, "bob"}, {&f.carol, "carol"}} {
		if *p.kp, err = ca.IssueClient(p.name); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// startServer starts another server of the fixture's CA with opts, closed
// when the test ends.
func (f *fixture) startServer(t testing.TB, opts testserver.Options) *testserver.Server {
	t.Helper()
	opts.CA = f.ca
	srv, err := testserver.Start(opts)
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	return srv
}

// kubeconfig writes a kubeconfig for client with certificate files beside it.
func (f *fixture) kubeconfig(t testing.TB, name string, client *testserver.KeyPair) testserver.Paths {
	t.Helper()
	paths, err := f.srv.WriteKubeconfig(filepath.Join(f.dir, name+".kubeconfig"), client, false)
	must(t, err)
	return paths
}

// must fails t at once on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func newPool(t testing.TB, opts ...Option) *Pool {
	t.Helper()
	p := New(opts...)
	t.Cleanup(func() { p.Close() })
	return p
}

func listNodes(ctx context.Context, cfg *rest.Config) error {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	_, err = cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	return err
}

func nilProxy(*http.Request) (*url.URL, error) { return nil, nil }

// seedLoad is the seed's load: workers x requests, each request through a
// fresh rest.Config (from the kubeconfig file) and a fresh clientset, which
// newClient builds.
func seedLoad(t testing.TB, workers, requests int, newClient func() (kubernetes.Interface, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	requireNoErrors(t, runClients(workers, requests, func(int, int) error {
		cs, err := newClient()
		if err != nil {
			return err
		}
		_, err = cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		return err
	}))
}

// wrapped returns a clientset for cfg after wrap(cfg).
func wrapped(cfg *rest.Config, wrap func(*rest.Config) error) (kubernetes.Interface, error) {
	if err := wrap(cfg); err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// pooledClientset returns a clientset for cfg over p.HTTPClientFor, the
// entry point for a config with a Proxy or Dial function.
func pooledClientset(p *Pool, cfg *rest.Config) (kubernetes.Interface, error) {
	hc, err := p.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfigAndClient(cfg, hc)
}

// declaredClientset hands cfg to p as a caller would, its wrappers declared
// by opts: through HTTPClientFor for a config with a Proxy or Dial
// (Wrap passes those through), through Wrap otherwise.
func declaredClientset(p *Pool, cfg *rest.Config, opts ...CallOption) (*kubernetes.Clientset, error) {
	if cfg.Proxy != nil || cfg.Dial != nil {
		hc, err := p.HTTPClientFor(cfg, opts...)
		if err != nil {
			return nil, err
		}
		return kubernetes.NewForConfigAndClient(cfg, hc)
	}
	if err := p.Wrap(cfg, opts...); err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// wrapFn and transportForFn are p.Wrap and p.TransportFor without
// declarations, in the shapes of client-go's functions they stand beside.
func wrapFn(p *Pool) func(*rest.Config) error { return func(c *rest.Config) error { return p.Wrap(c) } }

func transportForFn(p *Pool) func(*rest.Config) (http.RoundTripper, error) {
	return func(c *rest.Config) (http.RoundTripper, error) { return p.TransportFor(c) }
}

// waitFor waits up to 10 s for cond.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Certificate files as a kubeconfig names them, written the way the real
// writers write them.

// certDir holds a client certificate, key and CA as files, written the way
// one of the real writers writes them.
type certDir struct {
	dir           string
	cert, key, ca string // the paths a kubeconfig names
	layout        string
	generation    int
}

const (
	inPlace      = "in-place rewrite"
	renameOver   = "temp file renamed over"
	secretVolume = "secret volume ..data swap"
	deleteCreate = "delete, then create later"
	certThenKey  = "cert written before key"
)

func newCertDir(t testing.TB, layout string, kp *testserver.KeyPair, ca []byte) *certDir {
	t.Helper()
	return writeCertDir(t, t.TempDir(), layout, kp, ca)
}

// writeCredFiles writes a CA, certificate and key file into dir (created if
// missing); later writes rename new files over them.
func writeCredFiles(t testing.TB, dir string, ca []byte, kp *testserver.KeyPair) *certDir {
	t.Helper()
	return writeCertDir(t, dir, renameOver, kp, ca)
}

func writeCertDir(t testing.TB, dir, layout string, kp *testserver.KeyPair, ca []byte) *certDir {
	t.Helper()
	must(t, os.MkdirAll(dir, 0o700))
	d := &certDir{dir: dir, layout: layout,
		cert: filepath.Join(dir, "tls.crt"), key: filepath.Join(dir, "tls.key"), ca: filepath.Join(dir, "ca.crt")}
	if layout == secretVolume {
		for _, name := range []string{"tls.crt", "tls.key", "ca.crt"} {
			must(t, os.Symlink(filepath.Join("..data", name), filepath.Join(dir, name)))
		}
	}
	d.write(t, kp, ca)
	return d
}

func (d *certDir) config(host string) *rest.Config {
	c := &rest.Config{Host: host}
	c.CertFile, c.KeyFile, c.CAFile = d.cert, d.key, d.ca
	return c
}

// wrapped returns a config naming d's files for host, wrapped by p, and a
// clientset built from it.
func (d *certDir) wrapped(t testing.TB, p *Pool, host string) (*rest.Config, kubernetes.Interface) {
	t.Helper()
	cfg := d.config(host)
	must(t, p.Wrap(cfg))
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	return cfg, cs
}

// write replaces the files' content with kp and ca, as d's layout does it.
func (d *certDir) write(t testing.TB, kp *testserver.KeyPair, ca []byte) {
	t.Helper()
	d.generation++
	must := func(err error) {
		must(t, err)
	}
	switch d.layout {
	case secretVolume:
		// kubelet's AtomicWriter: a timestamped directory, a new ..data
		// symlink renamed over the old one, the old directory removed.
		ts := fmt.Sprintf("..2026_12_02_18_00_%02d.%d", d.generation, time.Now().UnixNano())
		must(os.Mkdir(filepath.Join(d.dir, ts), 0o755))
		must(os.WriteFile(filepath.Join(d.dir, ts, "tls.crt"), kp.CertPEM, 0o644))
		must(os.WriteFile(filepath.Join(d.dir, ts, "tls.key"), kp.KeyPEM, 0o600))
		must(os.WriteFile(filepath.Join(d.dir, ts, "ca.crt"), ca, 0o644))
		old, _ := os.Readlink(filepath.Join(d.dir, "..data"))
		must(os.Symlink(ts, filepath.Join(d.dir, "..data_tmp")))
		must(os.Rename(filepath.Join(d.dir, "..data_tmp"), filepath.Join(d.dir, "..data")))
		if old != "" {
			must(os.RemoveAll(filepath.Join(d.dir, old)))
		}
	case renameOver:
		for path, data := range map[string][]byte{d.cert: kp.CertPEM, d.key: kp.KeyPEM, d.ca: ca} {
			writeAtomic(t, path, data)
		}
	case deleteCreate:
		if d.generation > 1 {
			for _, path := range []string{d.cert, d.key} {
				must(os.Remove(path))
			}
			time.Sleep(time.Second) // the files are missing meanwhile
		}
		must(os.WriteFile(d.ca, ca, 0o644))
		must(os.WriteFile(d.cert, kp.CertPEM, 0o644))
		must(os.WriteFile(d.key, kp.KeyPEM, 0o600))
	case certThenKey:
		must(os.WriteFile(d.ca, ca, 0o644))
		must(os.WriteFile(d.cert, kp.CertPEM, 0o644))
		if d.generation > 1 {
			time.Sleep(500 * time.Millisecond) // torn pair, longer than the debounce
		}
		must(os.WriteFile(d.key, kp.KeyPEM, 0o600))
	default: // inPlace: truncate, then write in several pieces
		for path, data := range map[string][]byte{d.ca: ca, d.cert: kp.CertPEM, d.key: kp.KeyPEM} {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			must(err)
			half := len(data) / 2
			_, err = f.Write(data[:half])
			must(err)
			must(f.Sync())
			time.Sleep(5 * time.Millisecond)
			_, err = f.Write(data[half:])
			must(err)
			must(f.Close())
		}
	}
}

// restore puts the good files back, whatever a badFile did.
func (c *certDir) restore(t testing.TB, ca []byte, kp *testserver.KeyPair) {
	t.Helper()
	for _, p := range []string{c.ca, c.cert, c.key} {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			must(t, os.Remove(p))
		}
	}
	c.write(t, kp, ca)
}

// The load loops: bounded workers issuing requests, their errors collected.

// runClients runs clients goroutines of requests calls each, started
// together, and returns the errors.
func runClients(clients, requests int, call func(client, i int) error) []error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	start := make(chan struct{})
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range requests {
				if err := call(c, i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

func checkNoErrors(t testing.TB, errs []error) {
	t.Helper()
	for i, err := range errs {
		if i == 5 {
			t.Errorf("... %d errors in all", len(errs))
			break
		}
		t.Error(err)
	}
}

// requireNoErrors is checkNoErrors, and the test stops on an error.
func requireNoErrors(t testing.TB, errs []error) {
	t.Helper()
	checkNoErrors(t, errs)
	if len(errs) > 0 {
		t.FailNow()
	}
}

// raceDetector reports whether the test binary was built with -race. The
// race detector slows TLS handshakes about tenfold, so the load tests send
// fewer requests under it; every path is still raced.
func raceDetector() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// Test doubles for the fault and isolation tests: a TCP relay that can stop
// forwarding without closing, internal/connectproxy's CONNECT proxy as the
// tests use it, a client-go exec credential plugin, and certificates that
// share a key.

// forwarder accepts loopback TCP connections and pipes each to an upstream
// connection. Connections it pipes can be black-holed: from then on bytes
// are read and dropped in both directions, and nothing is closed, as a
// stateful firewall or a dead peer behind a NAT would do.
type forwarder struct {
	ln net.Listener
	// upstream dials the other side for a new client connection.
	upstream func() (net.Conn, error)

	accepted       atomic.Int64 // client connections accepted
	hops           sync.Map     // "local|remote" of every open upstream connection -> [2]string{client's address, f's address}
	closedByClient atomic.Int64 // client connections that ended from the client's side

	mu     sync.Mutex // guards pipes and closed
	pipes  map[*pipe]struct{}
	closed bool
	wg     sync.WaitGroup
}

type pipe struct {
	client, upstream net.Conn
	dead             atomic.Bool // black-holed
}

// newRelay forwards every connection to target.
func newRelay(t testing.TB, target string) *forwarder {
	t.Helper()
	return startForwarder(t, &forwarder{upstream: func() (net.Conn, error) { return net.Dial("tcp", target) }})
}

// connectProxy is internal/connectproxy's CONNECT proxy, closed when the
// test ends.
type connectProxy struct{ *connectproxy.Proxy }

// newConnectProxy is a CONNECT proxy that accepts every CONNECT.
func newConnectProxy(t testing.TB) *connectProxy {
	t.Helper()
	return startConnectProxy(t, connectproxy.Options{})
}

// newAuthProxy is a CONNECT proxy that answers 407 to a CONNECT whose
// Proxy-Authorization is not one of values.
func newAuthProxy(t testing.TB, values ...string) *connectProxy {
	t.Helper()
	return startConnectProxy(t, connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: values})
}

func startConnectProxy(t testing.TB, o connectproxy.Options) *connectProxy {
	t.Helper()
	p, err := connectproxy.Start(o)
	must(t, err)
	t.Cleanup(func() { p.Close() })
	return &connectProxy{p}
}

func (p *connectProxy) url() string { return p.URL() }

// carriedTo reports whether the connection a server at dest sees from addr
// came through a tunnel of p, and returns the ends of the client's
// connection to p, as forwarder.carriedTo does.
func (p *connectProxy) carriedTo(addr, dest string) (from, fromDest string, ok bool) {
	tn, ok := p.Carried(addr, dest)
	return tn.Client, tn.Proxy, ok
}

func startForwarder(t testing.TB, f *forwarder) *forwarder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	f.ln = ln
	f.pipes = map[*pipe]struct{}{}
	f.wg.Add(1)
	go f.serve()
	t.Cleanup(f.close)
	return f
}

func (f *forwarder) addr() string { return f.ln.Addr().String() }

func (f *forwarder) serve() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.accepted.Add(1)
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			f.handle(c)
		}()
	}
}

func (f *forwarder) handle(c net.Conn) {
	up, err := f.upstream()
	if err != nil {
		c.Close()
		return
	}
	hop := up.LocalAddr().String() + "|" + up.RemoteAddr().String()
	f.hops.Store(hop, [2]string{c.RemoteAddr().String(), c.LocalAddr().String()})
	defer f.hops.Delete(hop) // a closed connection's port is reused
	p := &pipe{client: c, upstream: up}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	f.pipes[p] = struct{}{}
	f.mu.Unlock()

	done := make(chan struct{}, 2)
	go func() { p.copy(up, c, func() { f.closedByClient.Add(1) }); done <- struct{}{} }()
	go func() { p.copy(c, up, nil); done <- struct{}{} }()
	<-done
	<-done
	f.mu.Lock()
	delete(f.pipes, p)
	f.mu.Unlock()
}

// copy forwards src to dst until src ends, then closes both. Once the pipe is
// black-holed, what is read is dropped and nothing is closed on a write.
func (p *pipe) copy(dst, src net.Conn, onSrcEnd func()) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.dead.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			if onSrcEnd != nil && !errors.Is(err, net.ErrClosed) {
				onSrcEnd()
			}
			p.client.Close()
			p.upstream.Close()
			return
		}
	}
}

// blackhole stops forwarding on every connection open now. New connections
// are forwarded as before.
func (f *forwarder) blackhole() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	for p := range f.pipes {
		p.dead.Store(true)
	}
	return len(f.pipes)
}

// carriedTo reports whether the connection a server at dest sees from addr
// is one of f's upstream connections, and returns the ends of the client
// connection it forwards. An ephemeral port is unique per destination only,
// so both ends name a connection.
func (f *forwarder) carriedTo(addr, dest string) (from, fromDest string, ok bool) {
	v, ok := f.hops.Load(addr + "|" + dest)
	if !ok {
		return "", "", false
	}
	ends := v.([2]string)
	return ends[0], ends[1], true
}

func (f *forwarder) open() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pipes)
}

func (f *forwarder) close() {
	f.mu.Lock()
	f.closed = true
	pipes := f.pipes
	f.pipes = map[*pipe]struct{}{}
	f.mu.Unlock()
	f.ln.Close()
	for p := range pipes {
		p.client.Close()
		p.upstream.Close()
	}
	f.wg.Wait()
}

// dial returns a rest.Config.Dial that connects to the forwarder whatever
// address it is asked for.
func (f *forwarder) dial() func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, f.addr())
	}
}

// issueForKey issues a client certificate for cn over an existing key, so a
// test can vary the certificate while the key stays the same.
func issueForKey(t testing.TB, ca *testserver.CA, cn string, key *testserver.KeyPair) *testserver.KeyPair {
	t.Helper()
	kp, err := ca.Issue(testserver.CertSpec{CommonName: cn, Client: true, Key: privateKey(t, key)})
	must(t, err)
	return kp
}

// privateKey parses a key pair's private key.
func privateKey(t testing.TB, kp *testserver.KeyPair) *ecdsa.PrivateKey {
	t.Helper()
	block, _ := pem.Decode(kp.KeyPEM)
	if block == nil {
		t.Fatal("no PEM key")
	}
	key, err := x509.ParseECPrivateKey(block.Bytes)
	must(t, err)
	return key
}

// pkcs8 returns the same key pair with its key encoded as PKCS #8: the same
// key, other bytes.
func pkcs8(t testing.TB, kp *testserver.KeyPair) *testserver.KeyPair {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(privateKey(t, kp))
	must(t, err)
	return &testserver.KeyPair{CertPEM: kp.CertPEM, KeyPEM: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), Cert: kp.Cert}
}

// writeExecPlugin writes a client-go credential plugin that prints kp as an
// ExecCredential, and returns the config that runs it.
func writeExecPlugin(t testing.TB, dir, name string, kp *testserver.KeyPair) *clientcmdapi.ExecConfig {
	t.Helper()
	writeExecCredential(t, dir, name, kp, time.Time{})
	script := filepath.Join(dir, name+".sh")
	must(t, os.WriteFile(script, []byte("#!/bin/sh\nexec cat '"+filepath.Join(dir, name+".json")+"'\n"), 0o700))
	return &clientcmdapi.ExecConfig{
		Command:         script,
		APIVersion:      "client.authentication.k8s.io/v1",
		InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
	}
}

// writeExecCredential sets what the plugin name prints next: kp, valid
// until expiry (zero: no expiry).
func writeExecCredential(t testing.TB, dir, name string, kp *testserver.KeyPair, expiry time.Time) {
	t.Helper()
	status := map[string]any{
		"clientCertificateData": string(kp.CertPEM),
		"clientKeyData":         string(kp.KeyPEM),
	}
	if !expiry.IsZero() {
		status["expirationTimestamp"] = expiry.UTC().Format(time.RFC3339)
	}
	cred, err := json.Marshal(map[string]any{
		"apiVersion": "client.authentication.k8s.io/v1",
		"kind":       "ExecCredential",
		"status":     status,
	})
	must(t, err)
	writeAtomic(t, filepath.Join(dir, name+".json"), cred)
}

// writeAtomic writes data to path the way careful tools do: a temporary file
// renamed over the old one, so a reader sees the old or the new bytes.
func writeAtomic(t testing.TB, path string, data []byte) {
	t.Helper()
	tmp := path + ".tmp"
	must(t, os.WriteFile(tmp, data, 0o600))
	must(t, os.Rename(tmp, path))
}

// tagRoundTripper appends "st-tag=<tag> st-cn=<cn>" to the User-Agent, so
// the server can check per request that the certificate on the connection is
// the one the sending config holds.
type tagRoundTripper struct {
	next     http.RoundTripper
	tag, cn  string
	requests atomic.Int64
}

func (r *tagRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	r.requests.Add(1)
	req = utilnet.CloneRequest(req)
	req.Header.Set("User-Agent", strings.TrimSpace(req.Header.Get("User-Agent")+" st-tag="+r.tag+" st-cn="+r.cn))
	return r.next.RoundTrip(req)
}

func (r *tagRoundTripper) WrappedRoundTripper() http.RoundTripper { return r.next }

// tag makes every request of cfg say which config sent it and which client
// certificate CN it holds.
func tag(cfg *rest.Config, tag, cn string) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &tagRoundTripper{next: rt, tag: tag, cn: cn} })
}

// parseTag reads what tag put in a User-Agent.
func parseTag(ua string) (tag, cn string, ok bool) {
	for _, f := range strings.Fields(ua) {
		switch {
		case strings.HasPrefix(f, "st-tag="):
			tag, ok = strings.TrimPrefix(f, "st-tag="), true
		case strings.HasPrefix(f, "st-cn="):
			cn = strings.TrimPrefix(f, "st-cn=")
		}
	}
	return tag, cn, ok
}

// connLedger is the server's side of the isolation check: which configs
// (tags) sent requests over which connection (remote address), and every
// request whose certificate was not the one its config holds.
type connLedger struct {
	mu         sync.Mutex
	byConn     map[string]map[string]int // remote address -> tag -> requests
	byTag      map[string]map[string]int // tag -> remote address -> requests
	mismatches []string
	requests   int
}

func newConnLedger() *connLedger {
	l := &connLedger{}
	l.reset()
	return l
}

func (l *connLedger) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.byConn = map[string]map[string]int{}
	l.byTag = map[string]map[string]int{}
	l.mismatches = nil
	l.requests = 0
}

func (l *connLedger) onRequest(ri testserver.RequestInfo) {
	tg, cn, ok := parseTag(ri.UserAgent)
	if !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.requests++
	if ri.CertCN != cn {
		l.mismatches = append(l.mismatches, fmt.Sprintf("config %s holds %q but its request %s came on a connection authenticated as %q",
			tg, cn, ri.Path, ri.CertCN))
	}
	if l.byConn[ri.RemoteAddr] == nil {
		l.byConn[ri.RemoteAddr] = map[string]int{}
	}
	l.byConn[ri.RemoteAddr][tg]++
	if l.byTag[tg] == nil {
		l.byTag[tg] = map[string]int{}
	}
	l.byTag[tg][ri.RemoteAddr]++
}

// snapshot returns the connections each tag used, the connections shared
// by more than one tag, and the certificate mismatches.
func (l *connLedger) snapshot() (conns map[string]int, shared int, mismatches []string, requests int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	conns = map[string]int{}
	for tg, addrs := range l.byTag {
		conns[tg] = len(addrs)
	}
	for _, tags := range l.byConn {
		if len(tags) > 1 {
			shared++
		}
	}
	return conns, shared, append([]string(nil), l.mismatches...), l.requests
}

// switchRelay forwards each new connection to the backend chosen last. A
// switch closes the connections open to the previous backend, as a failover
// to another server on the same address does.
type switchRelay struct {
	*forwarder
	target atomic.Value // string: host:port of the backend
}

func newSwitchRelay(t testing.TB, target string) *switchRelay {
	t.Helper()
	r := &switchRelay{}
	r.target.Store(target)
	r.forwarder = startForwarder(t, &forwarder{upstream: func() (net.Conn, error) {
		return net.Dial("tcp", r.target.Load().(string))
	}})
	return r
}

func (r *switchRelay) switchTo(target string) {
	r.target.Store(target)
	r.mu.Lock()
	pipes := r.pipes
	r.pipes = map[*pipe]struct{}{}
	r.mu.Unlock()
	for p := range pipes {
		p.client.Close()
		p.upstream.Close()
	}
}

// requestHold makes a test server hold every request whose User-Agent
// contains "hold" until the test releases them: a slow list, a watch whose
// headers come late, a hung server.
type requestHold struct {
	held    atomic.Int64
	release chan struct{}
	one     chan struct{} // releaseOne: one held request goes
	once    sync.Once
}

// newRequestHold returns a hold released when the test ends (before the
// server closes, so no handler is left waiting).
func newRequestHold(t testing.TB) *requestHold {
	h := &requestHold{release: make(chan struct{}), one: make(chan struct{})}
	t.Cleanup(h.releaseAll)
	return h
}

func (h *requestHold) onRequest(ri testserver.RequestInfo) {
	if strings.Contains(ri.UserAgent, "hold") {
		h.held.Add(1)
		select {
		case <-h.release:
		case <-h.one:
		}
	}
}

func (h *requestHold) releaseAll() { h.once.Do(func() { close(h.release) }) }

// releaseOne lets one held request go, waiting until one is held.
func (h *requestHold) releaseOne() { h.one <- struct{}{} }

// openFDs returns the numbers of this process's open file descriptors
// (/proc/self/fd).
func openFDs(t testing.TB) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	fds := make([]int, 0, len(entries))
	for _, e := range entries {
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			fds = append(fds, fd)
		}
	}
	return fds
}

// countFDs is how many file descriptors this process has open.
func countFDs(t testing.TB) int {
	t.Helper()
	return len(openFDs(t))
}
