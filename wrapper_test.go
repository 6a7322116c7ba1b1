package sharedtransport

// Copy safety, end to end: a copy of a wrapped config (rest.CopyConfig), or
// the config changed in place after Wrap, must reach the server exactly as
// the same config reaches it through client-go alone. Every case compares,
// request by request, what the server, the CONNECT proxies and the relays saw
// for the copy with what they saw for its control: the same copy made from an
// unwrapped twin of the original.

import (
	"context"
	"crypto/tls"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/transport"
	"k8s.io/klog/v2"

	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// observation is what the far side saw of one request: the server's view of
// the connection and headers, and which proxy or relay carried it.
type observation struct {
	Err   string // the class of error the client got; the rest is empty then
	CN    string // client certificate on the connection
	Token string // bearer token
	Proto string
	Gzip  bool   // the request asked for a compressed response
	Via   string // "direct", "proxy 1", "relay 2", ...
}

// copyRig is a TLS server (HTTP/2, client certificates, tokens) with two
// CONNECT proxies and two relays in front of it, recording every tagged
// request.
type copyRig struct {
	srv     *testserver.Server
	proxies [2]*connectProxy
	relays  [2]*forwarder
	dialers [2]*markedDialer
	// keepConns leaves connections open between observations (tests that
	// count connections); by default each observation starts a new one.
	keepConns bool

	n    atomic.Int64
	mu   sync.Mutex
	seen map[string]testserver.RequestInfo // tag -> the request
}

func newCopyRig(t testing.TB, opts testserver.Options) *copyRig {
	t.Helper()
	r := &copyRig{seen: map[string]testserver.RequestInfo{}}
	opts.OnRequest = r.record
	opts.Tokens = map[string]string{"token-x": "x", "token-y": "y"}
	opts.ClientAuth = testserver.VerifyClientCertIfGiven
	srv, err := testserver.Start(opts)
	must(t, err)
	t.Cleanup(func() { srv.Close() })
	r.srv = srv
	for i := range 2 {
		r.proxies[i] = newConnectProxy(t)
		r.relays[i] = newRelay(t, srv.Addr())
		r.dialers[i] = &markedDialer{}
	}
	return r
}

func (r *copyRig) record(ri testserver.RequestInfo) {
	tg, _, ok := parseTag(ri.UserAgent)
	if !ok {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen[tg] = ri
}

// rigClient is one clientset, kept so a test can send through it again (a
// client built before a rotation).
type rigClient struct {
	r   *copyRig
	cs  *kubernetes.Clientset
	tag string
	err error
}

// client builds a clientset from cfg (a copy of it, tagged; cfg is unchanged).
func (r *copyRig) client(cfg *rest.Config) *rigClient {
	return r.clientBy(cfg, kubernetes.NewForConfig)
}

// clientBy is client, with the clientset built by build.
func (r *copyRig) clientBy(cfg *rest.Config, build func(*rest.Config) (*kubernetes.Clientset, error)) *rigClient {
	c := &rigClient{r: r, tag: fmt.Sprint("c", r.n.Add(1))}
	cfg = rest.CopyConfig(cfg)
	tag(cfg, c.tag, "")
	c.cs, c.err = build(cfg)
	return c
}

func (c *rigClient) observe() observation {
	if c.err != nil {
		return observation{Err: errorClass(c.err)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// A new connection, so the handshake shows what the client presents now:
	// client-go reads certificate files again only for a new handshake.
	if rc, ok := c.cs.CoreV1().RESTClient().(*rest.RESTClient); ok && !c.r.keepConns {
		utilnet.CloseIdleConnectionsFor(rc.Client.Transport)
	}
	c.r.mu.Lock()
	delete(c.r.seen, c.tag)
	c.r.mu.Unlock()
	var o observation
	if _, err := c.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		o.Err = errorClass(err)
	}
	c.r.mu.Lock()
	ri, ok := c.r.seen[c.tag]
	c.r.mu.Unlock()
	if !ok {
		if o.Err == "" {
			o.Err = "the server saw no request"
		}
		return o
	}
	o.CN, o.Token, o.Proto, o.Gzip = ri.CertCN, ri.Token, ri.Proto, strings.Contains(ri.AcceptEncoding, "gzip")
	o.Via = c.r.via(ri.RemoteAddr, c.r.srv.Addr())
	return o
}

// via names the hops a connection the server saw from addr (to dest, the
// server's address) came through.
func (r *copyRig) via(addr, dest string) string {
	var hops []string
	for hop := true; hop; {
		hop = false
		for i, f := range []interface {
			carriedTo(addr, dest string) (string, string, bool)
		}{r.proxies[0], r.proxies[1], r.relays[0], r.relays[1]} {
			if from, fromDest, ok := f.carriedTo(addr, dest); ok {
				hops = append(hops, [...]string{"proxy 1", "proxy 2", "relay 1", "relay 2"}[i])
				addr, dest, hop = from, fromDest, true
				break
			}
		}
	}
	for i, d := range r.dialers {
		if _, ok := d.conns.Load(addr + "|" + dest); ok {
			hops = append(hops, fmt.Sprint("dialer ", i+1))
		}
	}
	if len(hops) == 0 {
		return "direct"
	}
	return strings.Join(hops, " < ")
}

// markedDialer dials the address it is asked for and remembers the local
// address of every connection it has open, so the far side can tell which
// dialer a connection came from.
type markedDialer struct{ conns sync.Map }

func (d *markedDialer) dial(ctx context.Context, network, address string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	d.conns.Store(c.LocalAddr().String()+"|"+c.RemoteAddr().String(), true)
	return &markedConn{Conn: c, d: d}, nil
}

type markedConn struct {
	net.Conn
	d *markedDialer
}

func (c *markedConn) Close() error {
	c.d.conns.Delete(c.LocalAddr().String() + "|" + c.RemoteAddr().String())
	return c.Conn.Close()
}

// observe sends one request through a new client of cfg.
func (r *copyRig) observe(cfg *rest.Config) observation { return r.client(cfg).observe() }

func errorClass(err error) string {
	s := err.Error()
	for _, class := range []string{"unknown authority", "certificate is valid for", "cannot be used in combination", "Unauthorized", "bad certificate", "no Auth Provider"} {
		if strings.Contains(s, class) {
			return class
		}
	}
	return "error"
}

// proxyTo returns a Proxy function sending every request through p.
func proxyTo(p *connectProxy) func(*http.Request) (*url.URL, error) {
	u, _ := url.Parse(p.url())
	return func(*http.Request) (*url.URL, error) { return u, nil }
}

// copyPair is a config wrapped in a pool and an unwrapped twin of it, the
// control.
type copyPair struct{ wrapped, control *rest.Config }

// wrapPair builds two originals and wraps the first in p.
func wrapPair(t testing.TB, p *Pool, newOriginal func() *rest.Config) copyPair {
	t.Helper()
	pair := copyPair{newOriginal(), newOriginal()}
	must(t, p.Wrap(pair.wrapped))
	return pair
}

// filesPairWithTwin returns a copy pair of configs reading alice's
// certificate files from d (the first wrapped in p), and twin, a second
// directory holding the same files: a copy naming twin's files reads, at
// first, the same bytes.
func filesPairWithTwin(t *testing.T, f *fixture, r *copyRig, p *Pool) (d, twin *certDir, pair copyPair) {
	t.Helper()
	d = newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	twin = newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair = wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
	return d, twin, pair
}

// copies applies mutate to a copy of each side.
func (pair copyPair) copies(mutate func(*rest.Config)) copyPair {
	w, c := rest.CopyConfig(pair.wrapped), rest.CopyConfig(pair.control)
	mutate(w)
	mutate(c)
	return copyPair{w, c}
}

// check asserts that the wrapped side is seen exactly as its control, and,
// when want is not nil, as want.
func (r *copyRig) check(t *testing.T, pair copyPair, want *observation) {
	t.Helper()
	got, control := r.observe(pair.wrapped), r.observe(pair.control)
	if got != control {
		t.Errorf("through the pool the far side saw %+v; through client-go alone %+v", got, control)
	}
	if want != nil && control != *want {
		t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", control, *want)
	}
}

// heldClients is a client of each side of a copy pair, built before the
// change a test then makes: [0] through the pool, [1] through client-go alone.
type heldClients [2]*rigClient

// hold builds a client of each side of pair and, when want is not nil,
// asserts that the far side sees each as want before the change.
func (r *copyRig) hold(t *testing.T, pair copyPair, want *observation) heldClients {
	t.Helper()
	h := heldClients{r.client(pair.wrapped), r.client(pair.control)}
	for i, c := range h {
		if o := c.observe(); want != nil && o != *want {
			t.Fatalf("client %d before the change: %+v, want %+v", i, o, *want)
		}
	}
	settleClientGoReloaders()
	return h
}

// checkAfterFileCache waits past client-go's one-second cache of
// certificate files and the pool's limit on a finding made by comparing
// what files hold (certSettle), then checks that the clients held before the
// change and new clients of pair are seen alike, as want.
func (r *copyRig) checkAfterFileCache(t *testing.T, before heldClients, pair copyPair, want observation) {
	t.Helper()
	time.Sleep(certSettle + 500*time.Millisecond)
	before.agree(t, &want)
	r.check(t, pair, &want)
}

// settleClientGoReloaders waits for the certificate reloaders of client-go
// transports just built to do their first load. client-go's reloader
// (transport/cert_rotation.go) reads the certificate it cached outside its
// lock: when its first load, which runs on a goroutine of its own as the
// transport is built, meets a file change and a handshake, the race
// detector reports that race inside client-go, with or without the pool.
// Tests that change certificate files under client-go transports they built
// a moment before wait here first: until every goroutine of a reloader
// waits (its first load done, its next one minutes away), however long a
// busy machine takes to schedule them.
func settleClientGoReloaders() {
	deadline := time.Now().Add(10 * time.Second)
	for !clientGoReloadersWaiting() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
}

// clientGoReloadersWaiting reports whether every goroutine of client-go's
// certificate reloaders is blocked, none of them in a load.
func clientGoReloadersWaiting() bool {
	buf := make([]byte, 16<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(g, "(*dynamicClientCert)") &&
			(strings.Contains(g, "loadClientCert") || strings.Contains(header, "[runnable") || strings.Contains(header, "[running")) {
			return false
		}
	}
	return true
}

// agree asserts that after the change the far side sees the held client
// through the pool exactly as the one through client-go alone, and, when
// want is not nil, the latter as want.
func (h heldClients) agree(t *testing.T, want *observation) {
	t.Helper()
	got, control := h[0].observe(), h[1].observe()
	if got != control {
		t.Errorf("client built before the change: through the pool %+v, through client-go alone %+v", got, control)
	}
	if want != nil && control != *want {
		t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", control, *want)
	}
}

// expect asserts what the far side sees for a new client of cfg.
func (r *copyRig) expect(t *testing.T, cfg *rest.Config, want observation) {
	t.Helper()
	if got := r.observe(cfg); got != want {
		t.Errorf("the far side saw %+v, want %+v", got, want)
	}
}

// h2 is the protocol an HTTP/2 request arrives with.
const h2 = "HTTP/2.0"

// TestCopyCrossings: the crossings the review of 2026-12-03 reproduced, each
// with its control.
func TestCopyCrossings(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	execAliceKP, err := f.ca.IssueClient("exec-alice")
	must(t, err)
	execAlice := writeExecPlugin(t, f.dir, "exec-alice", execAliceKP)
	withExec := func() *rest.Config {
		c := r.srv.RestConfig(nil)
		e := *execAlice
		c.ExecProvider = &e
		return c
	}

	t.Run("exec plugin", func(t *testing.T) { copyCrossingsExec(t, f, r, withExec) })

	// Files rotate from alice to bob; copies hold alice's material in other
	// ways. Past material of the original never vouches for them.
	t.Run("rotated-away certificate", func(t *testing.T) { copyCrossingsRotatedCert(t, f, r) })
	t.Run("other files with the same bytes", func(t *testing.T) { copyCrossingsSameBytes(t, f, r) })
	t.Run("rotated-away CA", func(t *testing.T) { copyCrossingsRotatedCA(t, f, r) })
	t.Run("a copy's own Dial", func(t *testing.T) { copyCrossingsOwnDial(t, f, r, withExec) })
	t.Run("Proxy for another host", func(t *testing.T) { copyCrossingsProxyOtherHost(t, f, r) })
	t.Run("compression and protocols", func(t *testing.T) { copyCrossingsCompression(t, f, r) })
}

// copyCrossingsExec is TestCopyCrossings's "exec plugin" case.
func copyCrossingsExec(t *testing.T, f *fixture, r *copyRig, withExec func() *rest.Config) {
	for _, tc := range []struct {
		name   string
		mutate func(*rest.Config)
		want   observation
	}{
		{"copy with a token", func(c *rest.Config) { c.BearerToken = "token-x" }, observation{Token: "token-x", Proto: h2, Gzip: true, Via: "direct"}},
		{"copy with basic auth", func(c *rest.Config) { c.Username, c.Password = "u", "p" }, observation{Err: "Unauthorized", Proto: h2, Gzip: true, Via: "direct"}},
		{"copy without the plugin", func(c *rest.Config) { c.ExecProvider = nil }, observation{Err: "Unauthorized", Proto: h2, Gzip: true, Via: "direct"}},
		{"copy with bob's certificate", func(c *rest.Config) { c.CertData, c.KeyData = f.bob.CertPEM, f.bob.KeyPEM }, observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t)
			pair := wrapPair(t, p, withExec)
			r.check(t, pair.copies(func(*rest.Config) {}), &observation{CN: "exec-alice", Proto: h2, Gzip: true, Via: "direct"})
			cp := pair.copies(tc.mutate)
			r.check(t, cp, &tc.want)
			t.Run("wrapped again, same pool", func(t *testing.T) {
				must(t, p.Wrap(cp.wrapped))
				r.check(t, cp, &tc.want)
			})
			t.Run("wrapped again, other pool", func(t *testing.T) {
				cp := pair.copies(tc.mutate)
				must(t, newPool(t).Wrap(cp.wrapped))
				r.check(t, cp, &tc.want)
			})
		})
	}
	t.Run("token set in place after Wrap", func(t *testing.T) {
		pair := wrapPair(t, newPool(t), withExec)
		r.check(t, pair, &observation{CN: "exec-alice", Proto: h2, Gzip: true, Via: "direct"})
		pair.wrapped.BearerToken, pair.control.BearerToken = "token-x", "token-x"
		r.check(t, pair, &observation{Token: "token-x", Proto: h2, Gzip: true, Via: "direct"})
	})
}

// copyCrossingsRotatedCert is TestCopyCrossings's "rotated-away certificate"
// case.
func copyCrossingsRotatedCert(t *testing.T, f *fixture, r *copyRig) {
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair := wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
	r.check(t, pair, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
	settleClientGoReloaders()
	d.write(t, f.bob, f.ca.CertPEM())
	waitFor(t, "rotation to bob", func() bool { return p.Stats().Rotations == 1 })
	waitFor(t, "the original presents bob", func() bool { return r.observe(pair.wrapped).CN == "bob" })
	inline := pair.copies(func(c *rest.Config) {
		c.CertFile, c.KeyFile, c.CertData, c.KeyData = "", "", f.alice.CertPEM, f.alice.KeyPEM
	})
	r.check(t, inline, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
}

// copyCrossingsSameBytes is TestCopyCrossings's "other files with the same
// bytes" case.
func copyCrossingsSameBytes(t *testing.T, f *fixture, r *copyRig) {
	p := newPool(t, WithPollInterval(0))
	d, same, pair := filesPairWithTwin(t, f, r, p)
	cp := pair.copies(func(c *rest.Config) { c.CertFile, c.KeyFile, c.CAFile = same.cert, same.key, same.ca })
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	before := r.hold(t, cp, &aliceSeen)
	d.write(t, f.carol, f.ca.CertPEM())
	waitFor(t, "rotation to carol", func() bool { return p.Stats().Rotations == 1 })
	before.agree(t, &aliceSeen)
	r.check(t, cp, &aliceSeen)
	waitFor(t, "the original moves to carol", func() bool { return r.observe(pair.wrapped).CN == "carol" })
}

// copyCrossingsRotatedCA is TestCopyCrossings's "rotated-away CA" case.
func copyCrossingsRotatedCA(t *testing.T, f *fixture, r *copyRig) {
	// Served from the new CA; client certificates still from the old.
	newCA, moved := newMovedRig(t, f)
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair := wrapPair(t, p, func() *rest.Config { return d.config(moved.srv.URL()) })
	moved.check(t, pair, &observation{Err: "unknown authority"})
	d.write(t, f.alice, newCA.CertPEM())
	waitFor(t, "the new CA is taken", func() bool { return p.Stats().Rotations == 1 })
	// client-go alone takes the new CA file later (v0.36+) or only for new
	// transports (before): the pool's own side is what is promised here.
	moved.expect(t, pair.wrapped, observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
	oldInline := pair.copies(func(c *rest.Config) { c.CAFile, c.CAData = "", f.ca.CertPEM() })
	moved.check(t, oldInline, &observation{Err: "unknown authority"})
}

// copyCrossingsOwnDial is TestCopyCrossings's "a copy's own Dial" case.
func copyCrossingsOwnDial(t *testing.T, f *fixture, r *copyRig, withExec func() *rest.Config) {
	for name, newOriginal := range map[string]func() *rest.Config{
		"inline certificate": func() *rest.Config { return r.srv.RestConfig(f.alice) },
		"certificate files":  func() *rest.Config { return newCertDir(t, inPlace, f.alice, f.ca.CertPEM()).config(r.srv.URL()) },
		"exec plugin":        withExec,
	} {
		t.Run(name, func(t *testing.T) {
			pair := wrapPair(t, newPool(t), newOriginal)
			cp := pair.copies(func(c *rest.Config) { c.Dial = r.relays[0].dial() })
			o := r.observe(cp.control)
			if o.Via != "relay 1" {
				t.Fatalf("control went %s, want relay 1", o.Via)
			}
			r.check(t, cp, nil)
		})
	}
}

// copyCrossingsProxyOtherHost is TestCopyCrossings's "Proxy for another host"
// case.
func copyCrossingsProxyOtherHost(t *testing.T, f *fixture, r *copyRig) {
	direct := r.srv.URL()
	other := strings.Replace(direct, "127.0.0.1", "localhost", 1)
	proxied, _ := url.Parse(r.proxies[0].url())
	ownHostDirect := func(req *http.Request) (*url.URL, error) {
		if "https://"+req.URL.Host == direct {
			return nil, nil
		}
		return proxied, nil
	}
	pair := wrapPair(t, newPool(t), func() *rest.Config {
		c := r.srv.RestConfig(f.alice)
		c.Proxy = ownHostDirect
		return c
	})
	r.check(t, pair, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
	r.check(t, pair.copies(func(c *rest.Config) { c.Host = other }), &observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 1"})
}

// copyCrossingsCompression is TestCopyCrossings's "compression and protocols"
// case.
func copyCrossingsCompression(t *testing.T, f *fixture, r *copyRig) {
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	r.check(t, pair.copies(func(c *rest.Config) { c.DisableCompression = true }), &observation{CN: "alice", Proto: h2, Via: "direct"})
	r.check(t, pair.copies(func(c *rest.Config) { c.NextProtos = []string{"http/1.1"} }), &observation{CN: "alice", Proto: "HTTP/1.1", Gzip: true, Via: "direct"})
	pair.wrapped.DisableCompression, pair.control.DisableCompression = true, true
	r.check(t, pair, &observation{CN: "alice", Proto: h2, Via: "direct"})
}

// copySpec is one random (original, mutation) pair for the property test.
type copySpec struct {
	original uint64 // cert source, CA source, exec, proxy, dial
	mutation uint64 // one bit per field of rest.Config that reaches the transport
	rotate   bool   // rotate the original's files between the two looks
}

// Mutations of a copy, one bit each.
var copyMutations = []struct {
	name   string
	mutate func(m *copyMaterial, c *rest.Config)
}{
	{"BearerToken", func(m *copyMaterial, c *rest.Config) { c.BearerToken = "token-y" }},
	{"Username", func(m *copyMaterial, c *rest.Config) { c.Username, c.Password = "u", "p" }},
	{"ExecProvider", func(m *copyMaterial, c *rest.Config) { e := *m.execBob; c.ExecProvider = &e }},
	{"no ExecProvider", func(m *copyMaterial, c *rest.Config) { c.ExecProvider = nil }},
	{"AuthProvider", func(m *copyMaterial, c *rest.Config) {
		c.AuthProvider = &clientcmdapi.AuthProviderConfig{Name: testAuthProvider, Config: map[string]string{"token": "token-x"}}
	}},
	{"Dial", func(m *copyMaterial, c *rest.Config) { c.Dial = m.rig.dialers[1].dial }},
	{"Proxy", func(m *copyMaterial, c *rest.Config) { c.Proxy = proxyTo(m.rig.proxies[1]) }},
	{"Proxy nil", func(m *copyMaterial, c *rest.Config) { c.Proxy = nil }},
	{"Host", func(m *copyMaterial, c *rest.Config) { c.Host = strings.Replace(c.Host, "127.0.0.1", "localhost", 1) }},
	{"DisableCompression", func(m *copyMaterial, c *rest.Config) { c.DisableCompression = !c.DisableCompression }},
	{"NextProtos", func(m *copyMaterial, c *rest.Config) { c.NextProtos = []string{"http/1.1"} }},
	{"CAData", func(m *copyMaterial, c *rest.Config) { c.CAFile, c.CAData = "", m.otherCA }},
	{"CAFile", func(m *copyMaterial, c *rest.Config) { c.CAFile, c.CAData = m.sameCAFile, nil }},
	{"CertData", func(m *copyMaterial, c *rest.Config) {
		c.CertFile, c.KeyFile, c.CertData, c.KeyData = "", "", m.f.bob.CertPEM, m.f.bob.KeyPEM
	}},
	{"CertFile", func(m *copyMaterial, c *rest.Config) {
		c.CertFile, c.KeyFile, c.CertData, c.KeyData = m.carolFiles.cert, m.carolFiles.key, nil, nil
	}},
	{"KeyData only", func(m *copyMaterial, c *rest.Config) { c.KeyData = m.f.bob.KeyPEM }},
}

// copyMaterial is what the property test builds configs from.
type copyMaterial struct {
	f          *fixture
	rig        *copyRig
	execAlice  *clientcmdapi.ExecConfig
	execBob    *clientcmdapi.ExecConfig
	otherCA    []byte
	sameCAFile string
	carolFiles *certDir
}

const testAuthProvider = "sharedtransport-test"

// tokenAuthProvider is an auth-provider plugin that sets a bearer token on
// every request, as client-go's plugins do, above WrapTransport.
type tokenAuthProvider struct{ token string }

func (a tokenAuthProvider) WrapTransport(rt http.RoundTripper) http.RoundTripper {
	return &tokenRoundTripper{next: rt, token: a.token}
}
func (tokenAuthProvider) Login() error { return nil }

type tokenRoundTripper struct {
	next  http.RoundTripper
	token string
}

func (t *tokenRoundTripper) WrappedRoundTripper() http.RoundTripper { return t.next }

func (t *tokenRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", "Bearer "+t.token)
	return t.next.RoundTrip(req)
}

var registerAuthProvider = sync.OnceValue(func() error {
	return rest.RegisterAuthProviderPlugin(testAuthProvider, func(_ string, cfg map[string]string, _ rest.AuthProviderConfigPersister) (rest.AuthProvider, error) {
		return tokenAuthProvider{cfg["token"]}, nil
	})
})

func newCopyMaterial(t testing.TB) *copyMaterial {
	t.Helper()
	must(t, registerAuthProvider())
	f := newFixture(t, testserver.Options{})
	m := &copyMaterial{f: f, rig: newCopyRig(t, testserver.Options{CA: f.ca})}
	issue := func(cn string) *testserver.KeyPair {
		kp, err := f.ca.IssueClient(cn)
		must(t, err)
		return kp
	}
	m.execAlice = writeExecPlugin(t, f.dir, "exec-alice", issue("exec-alice"))
	m.execBob = writeExecPlugin(t, f.dir, "exec-bob", issue("exec-bob"))
	other, err := testserver.NewCA("other")
	must(t, err)
	m.otherCA = other.CertPEM()
	m.carolFiles = newCertDir(t, inPlace, f.carol, f.ca.CertPEM())
	m.sameCAFile = m.carolFiles.ca
	return m
}

// originalFor builds the original config spec describes, and the certDir
// whose files it names (nil when inline).
func (m *copyMaterial) originalFor(t testing.TB, spec uint64) (func() *rest.Config, *certDir) {
	t.Helper()
	var d *certDir
	exec := spec&2 != 0
	if spec&1 != 0 && !exec {
		d = newCertDir(t, renameOver, m.f.alice, m.f.ca.CertPEM())
	}
	proxy := (spec >> 2) % 3 // none, proxy 1, direct by function
	dial := spec&32 != 0
	return func() *rest.Config {
		var c *rest.Config
		switch {
		case exec:
			c = m.rig.srv.RestConfig(nil)
			e := *m.execAlice
			c.ExecProvider = &e
		case d != nil:
			c = d.config(m.rig.srv.URL())
		default:
			c = m.rig.srv.RestConfig(m.f.alice)
		}
		switch proxy {
		case 1:
			c.Proxy = proxyTo(m.rig.proxies[0])
		case 2:
			c.Proxy = nilProxy
		}
		if dial {
			c.Dial = m.rig.dialers[0].dial
		}
		return c
	}, d
}

// checkCopy runs one pair: a client of the copy through the pool must be
// seen as the same copy through client-go alone, before and after a rotation
// of the original's files, for clients built before and after it.
func (m *copyMaterial) checkCopy(t *testing.T, s copySpec) {
	t.Helper()
	p := newPool(t, WithPollInterval(0), WithDialIdentity(func(*rest.Config) string { return "dialer 1" }))
	newOriginal, d := m.originalFor(t, s.original)
	if (s.original+s.mutation)%2 == 1 {
		// Half the pairs: another config of the identity wrapped
		// first, so that the pair's hooks decide from what client-go's
		// cache was found to hold for that config.
		must(t, p.Wrap(newOriginal()))
	}
	pair := wrapPair(t, p, newOriginal)
	var names []string
	cp := pair.copies(func(c *rest.Config) {
		for i, mu := range copyMutations {
			if s.mutation&(1<<i) != 0 {
				mu.mutate(m, c)
			}
		}
	})
	for i, mu := range copyMutations {
		if s.mutation&(1<<i) != 0 {
			names = append(names, mu.name)
		}
	}
	what := fmt.Sprintf("original %06b, copy with %v", s.original, names)
	early := [2]*rigClient{m.rig.client(cp.wrapped), m.rig.client(cp.control)}
	if got, control := early[0].observe(), early[1].observe(); got != control {
		t.Errorf("%s: through the pool %+v, through client-go alone %+v", what, got, control)
	}
	functions := pair.wrapped.Proxy != nil || pair.wrapped.Dial != nil
	if st := p.Stats(); functions && (st.Identities != 0 || st.PassThrough == 0) {
		t.Errorf("%s: pool %+v, want the original with a Proxy or Dial passed through by Wrap", what, st)
	}
	if !s.rotate || d == nil {
		return
	}
	rotations := p.Stats().Rotations
	settleClientGoReloaders()
	d.write(t, m.f.bob, m.f.ca.CertPEM())
	if !functions {
		waitFor(t, "rotation", func() bool { return p.Stats().Rotations > rotations })
	}
	time.Sleep(certSettle) // past client-go's own certificate cache, so the controls are settled too
	if got, control := early[0].observe(), early[1].observe(); got != control {
		t.Errorf("%s, client built before the rotation: through the pool %+v, through client-go alone %+v", what, got, control)
	}
	if got, control := m.rig.observe(cp.wrapped), m.rig.observe(cp.control); got != control {
		t.Errorf("%s, client built after the rotation: through the pool %+v, through client-go alone %+v", what, got, control)
	}
}

func randomCopySpec(rnd *rand.Rand) copySpec {
	var mutation uint64
	for range 1 + rnd.IntN(3) {
		mutation |= 1 << rnd.IntN(len(copyMutations))
	}
	return copySpec{original: rnd.Uint64N(64), mutation: mutation, rotate: rnd.IntN(4) == 0}
}

// TestCopyProperty: random originals and copies, over every field of
// rest.Config that reaches the transport.
func TestCopyProperty(t *testing.T) {
	m := newCopyMaterial(t)
	trials := 48
	if testing.Short() {
		trials = 12
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewPCG(seed, 0))
	// Every mutation alone on every kind of original first, then random pairs.
	var specs []copySpec
	for i := range copyMutations {
		specs = append(specs, copySpec{original: uint64(i % 64), mutation: 1 << i})
	}
	for range trials {
		specs = append(specs, randomCopySpec(rnd))
	}
	for _, s := range specs {
		m.checkCopy(t, s)
		if t.Failed() {
			return
		}
	}
}

// FuzzCopySafety explores (original, copy) pairs beyond the property test's.
func FuzzCopySafety(f *testing.F) {
	for i := range copyMutations {
		f.Add(uint64(i%64), uint64(1)<<i, false)
	}
	f.Add(uint64(1), uint64(1<<13), true)
	m := newCopyMaterial(f)
	f.Fuzz(func(t *testing.T, original, mutation uint64, rotate bool) {
		mutation &= 1<<len(copyMutations) - 1
		m.checkCopy(t, copySpec{original % 64, mutation, rotate})
	})
}

// TestProxyConnectHeader: Karmada-shaped member configs (token, CA data, a
// proxy URL that needs a header) through a CONNECT proxy that refuses tunnels
// without it, counted at the proxy.
func TestProxyConnectHeader(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := &proxyHeaderRig{copyRig: newCopyRig(t, testserver.Options{CA: f.ca}), caPEM: f.ca.CertPEM()}
	r.keepConns = true
	t.Run("one tunnel for many configs of one identity and header", func(t *testing.T) { proxyHeaderOneTunnel(t, r) })
	t.Run("client-go alone: a tunnel per config, each with the header", func(t *testing.T) { proxyHeaderClientGoAlone(t, r) })
	t.Run("other headers, other tunnels", func(t *testing.T) { proxyHeaderOtherHeaders(t, r) })
	t.Run("a wrapper that changes more than CONNECT headers passes the config through", func(t *testing.T) { proxyHeaderOwnDialer(t, r) })
	t.Run("undeclared, the config passes through: a tunnel per config, none refused", func(t *testing.T) { proxyHeaderUndeclared(t, r) })
	t.Run("declared for TransportFor and HTTPClientFor", func(t *testing.T) { proxyHeaderPerRequest(t, r) })
}

// proxyHeaderUndeclared is TestProxyConnectHeader's "undeclared" case: Wrap
// cannot read the wrapper, so every config passes through and behaves as
// with client-go alone.
func proxyHeaderUndeclared(t *testing.T, r *proxyHeaderRig) {
	proxy := r.newProxy(t)
	p := newPool(t)
	for range 5 {
		cfg := r.member(proxy, "token-x", proxyCredA)
		must(t, p.Wrap(cfg))
		r.mustObserve(t, cfg)
	}
	wantTunnels(t, proxy, 5, "5 configs with an undeclared wrapper")
	if st := p.Stats(); st.PassThrough != 5 || st.Identities != 0 {
		t.Errorf("pool %+v, want 5 configs passed through", st)
	}
}

// proxyHeaderPerRequest is TestProxyConnectHeader's "declared for
// TransportFor and HTTPClientFor" case: one tunnel for configs built per
// request, the header on it; undeclared, they pass through.
func proxyHeaderPerRequest(t *testing.T, r *proxyHeaderRig) {
	proxy := r.newProxy(t)
	p := newPool(t)
	declared := WithProxyConnectHeader(proxyCredA)
	for i := range 20 {
		cfg := r.member(proxy, "token-x", proxyCredA)
		var err error
		if i%2 == 0 {
			_, err = p.TransportFor(cfg, declared)
		} else {
			_, err = p.HTTPClientFor(cfg, declared)
		}
		must(t, err)
	}
	for i := range 20 {
		cfg := r.member(proxy, "token-x", proxyCredA)
		c, err := p.HTTPClientFor(cfg, declared)
		must(t, err)
		resp, err := c.Get(r.srv.URL() + "/api/v1/nodes")
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
	}
	wantTunnels(t, proxy, 1, "20 per-request configs, declared")
	if h := proxy.Tunnels()[0].Header.Get("Proxy-Authorization"); h != "Basic a" {
		t.Errorf("the tunnel carried %q", h)
	}
	before := p.Stats().PassThrough
	if _, err := p.TransportFor(r.member(proxy, "token-x", proxyCredA)); err != nil {
		t.Fatal(err)
	}
	if n := p.Stats().PassThrough - before; n != 1 {
		t.Errorf("TransportFor of an undeclared wrapper: %d passed through, want 1", n)
	}
}

// proxyHeaderRig is TestProxyConnectHeader's server, with the members'
// configs as Karmada builds them.
type proxyHeaderRig struct {
	*copyRig
	caPEM []byte
}

// The credentials the members' CONNECT headers carry.
var (
	proxyCredA = http.Header{"Proxy-Authorization": {"Basic a"}}
	proxyCredB = http.Header{"Proxy-Authorization": {"Basic b"}}
)

// newProxy is a CONNECT proxy that takes either credential.
func (r *proxyHeaderRig) newProxy(t *testing.T) *connectProxy {
	return newAuthProxy(t, "Basic a", "Basic b")
}

// member is a member's config with token, through proxy, with h on the
// CONNECT from a Karmada-style wrapper (none when nil).
func (r *proxyHeaderRig) member(proxy *connectProxy, token string, h http.Header) *rest.Config {
	cfg := &rest.Config{Host: r.srv.URL(), BearerToken: token}
	cfg.CAData = r.caPEM
	cfg.Proxy = proxyTo(proxy)
	if h != nil {
		cfg.WrapTransport = memberproxy.ProxyHeaderWrapper(cfg.WrapTransport, h)
	}
	return cfg
}

// mustObserve observes a request of cfg and fails t unless it succeeded.
// (The rig's via cannot tell the auth proxy's tunnels: the proxy's Stats
// say where requests went.)
func (r *proxyHeaderRig) mustObserve(t *testing.T, cfg *rest.Config) observation {
	t.Helper()
	return mustSucceed(t, r.observe(cfg))
}

// mustObserveDeclared is mustObserve with cfg given to p, h declared.
func (r *proxyHeaderRig) mustObserveDeclared(t *testing.T, p *Pool, cfg *rest.Config, h http.Header) observation {
	t.Helper()
	return mustSucceed(t, r.clientBy(cfg, func(cfg *rest.Config) (*kubernetes.Clientset, error) {
		return declaredClientset(p, cfg, WithProxyConnectHeader(h))
	}).observe())
}

func mustSucceed(t *testing.T, o observation) observation {
	t.Helper()
	if o.Err != "" {
		t.Fatalf("%+v", o)
	}
	return o
}

// wantTunnels fails t unless proxy opened n tunnels and refused none.
func wantTunnels(t *testing.T, proxy *connectProxy, n uint64, what string) {
	t.Helper()
	if got, rej := proxy.Stats().Tunnels, proxy.Stats().Rejected; got != n || rej != 0 {
		t.Errorf("%s: the proxy opened %d tunnels and refused %d, want %d and 0", what, got, rej, n)
	}
}

// proxyHeaderOneTunnel is TestProxyConnectHeader's "one tunnel for many
// configs of one identity and header" case.
func proxyHeaderOneTunnel(t *testing.T, r *proxyHeaderRig) {
	const reconciles = 40
	proxy := r.newProxy(t)
	p := newPool(t)
	for i := range reconciles {
		cfg := r.member(proxy, "token-x", proxyCredA)
		if o := r.mustObserveDeclared(t, p, cfg, proxyCredA); o.Token != "token-x" {
			t.Fatalf("reconcile %d: %+v", i, o)
		}
	}
	wantTunnels(t, proxy, 1, fmt.Sprintf("%d configs", reconciles))
	for _, tn := range proxy.Tunnels() {
		if h := tn.Header.Get("Proxy-Authorization"); h != "Basic a" {
			t.Errorf("tunnel %s carried %q", tn.Upstream, h)
		}
	}
}

// proxyHeaderClientGoAlone is TestProxyConnectHeader's "client-go alone: a
// tunnel per config, each with the header" case.
func proxyHeaderClientGoAlone(t *testing.T, r *proxyHeaderRig) {
	proxy := r.newProxy(t)
	for range 5 {
		r.mustObserve(t, r.member(proxy, "token-x", proxyCredA))
	}
	wantTunnels(t, proxy, 5, "client-go alone")
}

// proxyHeaderOtherHeaders is TestProxyConnectHeader's "other headers, other
// tunnels" case.
func proxyHeaderOtherHeaders(t *testing.T, r *proxyHeaderRig) {
	proxy := r.newProxy(t)
	p := newPool(t)
	for range 3 {
		for _, h := range []http.Header{proxyCredA, proxyCredB} {
			r.mustObserveDeclared(t, p, r.member(proxy, "token-x", h), h)
		}
	}
	if n := proxy.Stats().Tunnels; n != 2 {
		t.Errorf("%d tunnels for two headers, want 2", n)
	}
	if got := p.Stats().Identities; got != 2 {
		t.Errorf("%d identities for two headers, want 2", got)
	}
	seen := map[string]bool{}
	for _, tn := range proxy.Tunnels() {
		seen[tn.Header.Get("Proxy-Authorization")] = true
	}
	if !seen["Basic a"] || !seen["Basic b"] {
		t.Errorf("tunnels carried %v, want both credentials", seen)
	}
}

// proxyHeaderOwnDialer is TestProxyConnectHeader's "a wrapper that changes
// more than CONNECT headers passes the config through" case.
func proxyHeaderOwnDialer(t *testing.T, r *proxyHeaderRig) {
	p := newPool(t)
	ownDialer := func(next transport.WrapperFunc) transport.WrapperFunc {
		return func(rt http.RoundTripper) http.RoundTripper {
			if t, ok := rt.(*http.Transport); ok {
				t = t.Clone()
				t.ProxyConnectHeader = proxyCredA.Clone()
				t.DialContext = r.dialers[0].dial
				rt = t
			}
			return next(rt)
		}
	}
	cfg := r.member(r.proxies[0], "token-x", nil)
	cfg.WrapTransport = ownDialer(func(rt http.RoundTripper) http.RoundTripper { return rt })
	control := rest.CopyConfig(cfg)
	must(t, p.Wrap(cfg))
	if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
		t.Errorf("pool %+v, want the config passed through", st)
	}
	if got, want := r.observe(cfg), r.observe(control); got != want || want.Via != "proxy 1 < dialer 1" {
		t.Errorf("through the pool %+v, client-go alone %+v (through proxy 1 from dialer 1)", got, want)
	}
}

// TestWrapPassesFunctionsThrough: Wrap leaves a config with a Proxy or Dial
// function untouched, counts it and logs once how to share it; its clients
// connect as client-go alone connects (one connection per client, counted by
// the server), and HTTPClientFor shares them.
func TestWrapPassesFunctionsThrough(t *testing.T) {
	logs := captureKlog(t, 2)
	f := newFixture(t, testserver.Options{})
	const clients = 3
	configs := map[string]func(*rest.Config){
		"Proxy": func(c *rest.Config) { c.Proxy = nilProxy },
		"Dial":  func(c *rest.Config) { c.Dial = (&net.Dialer{}).DialContext },
	}
	for name, set := range configs {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, WithDialIdentity(func(*rest.Config) string { return "plain" }))
			accepted := func(give func(*rest.Config) kubernetes.Interface) uint64 {
				f.srv.CloseClientConnections()
				f.srv.ResetStats()
				for range clients {
					cfg := f.srv.RestConfig(f.alice)
					set(cfg)
					listNodesOf(t, give(cfg))
				}
				return f.srv.Stats().Accepted
			}
			alone := accepted(func(cfg *rest.Config) kubernetes.Interface { return mustClientset(t, cfg) })
			through := accepted(func(cfg *rest.Config) kubernetes.Interface {
				must(t, p.Wrap(cfg))
				if cfg.WrapTransport != nil {
					t.Error("Wrap set WrapTransport on a config with a function")
				}
				return mustClientset(t, cfg)
			})
			if st := p.Stats(); st.PassThrough != clients || st.Identities != 0 {
				t.Errorf("pool %+v, want %d configs passed through", st, clients)
			}
			shared := accepted(func(cfg *rest.Config) kubernetes.Interface { return mustPooled(t, p, cfg) })
			if alone != clients || through != alone || shared != 1 {
				t.Errorf("server accepted %d connections for %d clients through Wrap, %d with client-go alone, %d through HTTPClientFor; want %d, %d, 1",
					through, clients, alone, shared, clients, clients)
			}
		})
	}
	klog.Flush()
	if n := strings.Count(logs.String(), "build its clients with HTTPClientFor"); n != len(configs) {
		t.Errorf("logged %d times how to share a config with a function, want once per pool (%d):\n%s", n, len(configs), logs)
	}
}

// TestWrapperChangingTransportInPlace: a wrapper in the config that changes
// the *http.Transport it is handed in place (here: compression off) would be
// handed the pool's round tripper and lose its effect; the config passes
// through instead and the server sees what client-go alone sends. One that
// sets only CONNECT headers in place is recognised as a header wrapper.
func TestWrapperChangingTransportInPlace(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	inPlace := func(change func(*http.Transport)) transport.WrapperFunc {
		return func(rt http.RoundTripper) http.RoundTripper {
			if t, ok := rt.(*http.Transport); ok {
				change(t)
			}
			return rt
		}
	}
	t.Run("compression off", func(t *testing.T) {
		p := newPool(t)
		cfg := r.srv.RestConfig(f.alice)
		// A Proxy (direct) makes the config one client-go cannot cache, so
		// it hands the wrapper its bare *http.Transport in every version.
		cfg.Proxy = nilProxy
		cfg.WrapTransport = inPlace(func(t *http.Transport) { t.DisableCompression = true })
		control := rest.CopyConfig(cfg)
		must(t, p.Wrap(cfg))
		if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
			t.Errorf("pool %+v, want the config passed through", st)
		}
		if got, want := r.observe(cfg), r.observe(control); got != want || want.Gzip {
			t.Errorf("through the pool %+v, client-go alone %+v (no gzip)", got, want)
		}
	})
	t.Run("CONNECT header set in place", func(t *testing.T) {
		proxy := newAuthProxy(t, "Basic a")
		header := http.Header{"Proxy-Authorization": {"Basic a"}}
		for _, declare := range []bool{false, true} {
			p := newPool(t)
			cfg := r.srv.RestConfig(f.alice)
			cfg.Proxy = proxyTo(proxy)
			cfg.WrapTransport = inPlace(func(t *http.Transport) { t.ProxyConnectHeader = header })
			var o observation
			want := Stats{PassThrough: 1}
			if declare {
				want = Stats{Identities: 1}
				o = r.clientBy(cfg, func(cfg *rest.Config) (*kubernetes.Clientset, error) {
					return declaredClientset(p, cfg, WithProxyConnectHeader(header))
				}).observe()
			} else {
				must(t, p.Wrap(cfg))
				o = r.observe(cfg)
			}
			if o.Err != "" || o.CN != "alice" {
				t.Fatalf("declared %v: %+v", declare, o)
			}
			if st := p.Stats(); st.PassThrough != want.PassThrough || st.Identities != want.Identities || proxy.Stats().Rejected != 0 {
				t.Errorf("declared %v: pool %+v, %d tunnels refused: want %d passed through and %d identities, none refused",
					declare, st, proxy.Stats().Rejected, want.PassThrough, want.Identities)
			}
		}
	})
}

// TestPassThroughCosts: copies of a wrapped config that client-go caches
// under another key than the config's (other files with the same bytes, the
// files' bytes inline, a Proxy added) keep client-go's transport, and cost
// what client-go alone costs them: the server accepts as many connections
// for their clients as for the same clients built without the pool.
func TestPassThroughCosts(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	ctx := context.Background()
	const clients = 4
	cases := map[string]func(d, twin *certDir, c *rest.Config){
		"other files, same bytes": func(_, twin *certDir, c *rest.Config) { c.CertFile, c.KeyFile, c.CAFile = twin.cert, twin.key, twin.ca },
		"the files' bytes inline": func(d, _ *certDir, c *rest.Config) {
			c.CertFile, c.KeyFile, c.CertData, c.KeyData = "", "", readFileT(t, d.cert), readFileT(t, d.key)
		},
		"a Proxy added": func(_, _ *certDir, c *rest.Config) { c.Proxy = nilProxy },
	}
	for name, change := range cases {
		t.Run(name, func(t *testing.T) {
			accepted := func(p *Pool, kp *testserver.KeyPair) uint64 {
				d := newCertDir(t, renameOver, kp, f.ca.CertPEM())
				twin := newCertDir(t, renameOver, kp, f.ca.CertPEM())
				cfg := d.config(f.srv.URL())
				if p != nil {
					must(t, p.Wrap(cfg))
					if err := listNodes(ctx, cfg); err != nil { // the pool's own connection
						t.Fatal(err)
					}
				}
				before := f.srv.Stats().Accepted
				for range clients {
					cp := rest.CopyConfig(cfg)
					change(d, twin, cp)
					must(t, listNodes(ctx, cp))
				}
				return f.srv.Stats().Accepted - before
			}
			pool := newPool(t)
			got, want := accepted(pool, f.alice), accepted(nil, f.bob)
			t.Logf("%d clients of the copy: %d connections through the pool, %d through client-go alone", clients, got, want)
			if got != want {
				t.Errorf("%d clients of the copy opened %d connections through the pool, %d through client-go alone", clients, got, want)
			}
			if n := pool.Stats().PassThrough; n != clients {
				t.Errorf("Stats.PassThrough = %d, want %d", n, clients)
			}
		})
	}
}

func readFileT(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	must(t, err)
	return b
}

// TestWrapConfigsOfOneIdentity: configs of one identity share the pool's
// connection, a config per request, whichever shape was wrapped first, also
// where client-go keys them apart: one names half a certificate pair (the
// certificate without its key), which client-go keys but presents no
// certificate for, as for the other. Wrap asks client-go for its cached
// transport once per identity, not per config; the hook of a config whose
// client-go transport is another one asks then. client-go alone opens a
// connection per cache key.
func TestWrapConfigsOfOneIdentity(t *testing.T) {
	f := newFixture(t, testserver.Options{ClientAuth: testserver.VerifyClientCertIfGiven, Tokens: map[string]string{"token-of-tom": "tom"}})
	shapes := []func() *rest.Config{
		func() *rest.Config { return f.srv.RestConfig(nil) },
		func() *rest.Config {
			c := f.srv.RestConfig(nil)
			c.CertData = f.alice.CertPEM // half a pair: no certificate presented
			return c
		},
	}
	const configs = 10 // a config per request, the two shapes in turn
	ctx := context.Background()
	accepted := func(p *Pool) uint64 {
		before := f.srv.Stats().Accepted
		for i := range configs {
			cfg := shapes[i%2]()
			cfg.BearerToken = "token-of-tom"
			if p != nil {
				must(t, p.Wrap(cfg))
			}
			must(t, listNodes(ctx, cfg))
		}
		return f.srv.Stats().Accepted - before
	}
	want := accepted(nil)
	p := newPool(t)
	got := accepted(p)
	st := p.Stats()
	t.Logf("%d configs of two client-go keys, one identity: %d connections through the pool, %d through client-go alone; %+v", configs, got, want, st)
	if want < 2 {
		t.Errorf("client-go alone opened %d connections for two cache keys, want 2 or more", want)
	}
	if got != 1 || st.PassThrough != 0 || st.Identities != 1 {
		t.Errorf("through the pool: %d connections, %d passed through, %d identities; want 1, 0, 1", got, st.PassThrough, st.Identities)
	}
	for _, r := range f.srv.Requests() {
		if r.User != "tom" || r.CertCN != "" {
			t.Errorf("a request reached the server as %q with certificate %q, want tom by token, no certificate", r.User, r.CertCN)
		}
	}
}

// TestWrapConcurrentClients: after a rotation, clients built at once from
// copies of a wrapped config and from other wrapped configs of the identity
// all ride the shared transport: the hooks ask client-go again, released
// together, and none passes a client through. The new certificate's
// transport dials for them as net/http dials on a cold start; client-go
// alone, which has not seen the rotation yet, serves them on the
// connection it has (logged).
func TestWrapConcurrentClients(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	const clients = 50
	accepted := func(p *Pool) uint64 {
		d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
		shared := d.config(f.srv.URL())
		configs := make([]*rest.Config, clients)
		for i := range configs {
			configs[i] = d.config(f.srv.URL())
		}
		for _, cfg := range append(configs[:clients/2:clients/2], shared) {
			if p != nil {
				must(t, p.Wrap(cfg))
			}
		}
		for i := clients / 2; i < clients; i++ {
			configs[i] = rest.CopyConfig(shared)
		}
		must(t, listNodes(context.Background(), shared))
		d.write(t, f.bob, f.ca.CertPEM())
		if p != nil {
			waitFor(t, "rotation", func() bool { return p.Stats().Rotations == 1 })
		}
		before := f.srv.Stats().Accepted
		start := make(chan struct{})
		errs := make(chan error, clients)
		for _, cfg := range configs {
			go func() {
				<-start
				errs <- listNodes(context.Background(), cfg)
			}()
		}
		close(start)
		for range clients {
			must(t, <-errs)
		}
		return f.srv.Stats().Accepted - before
	}
	want := accepted(nil)
	p := newPool(t)
	got := accepted(p)
	st := p.Stats()
	t.Logf("%d clients built at once after a rotation: %d connections through the pool, %d through client-go alone; %+v", clients, got, want, st)
	if st.PassThrough != 0 || st.Identities != 1 {
		t.Errorf("through the pool: %d passed through, %d identities; want 0, 1", st.PassThrough, st.Identities)
	}
}

// TestCopyNeverFollowsAnUnnamedCAFile: a config naming a CA file is wrapped,
// and copies of it carry the same CA otherwise: its bytes inline, all files
// loaded inline (rest.LoadTLSFiles), or another file with the same bytes.
// Clients of the copies are built, then the wrapped file moves to another
// CA. client-go before v0.36 (and later with ClientsAllowCARotation off)
// keys its cache by the CA's bytes, so it hands the hook the very transport
// it holds for the wrapped config; through client-go alone the copies go on
// trusting the CA they carry, and must through the pool too: the server of
// the old CA answers them, the server of the new one never sees their
// requests. The test runs again in a child process with the gate off, which
// makes client-go v0.36 and later behave as older versions do.
func TestCopyNeverFollowsAnUnnamedCAFile(t *testing.T) {
	rerunWithClientGoGates(t, "KUBE_FEATURE_ClientsAllowCARotation=false")
	f := newFixture(t, testserver.Options{})
	oldServer := newCopyRig(t, testserver.Options{CA: f.ca})
	newCA, newServer := newMovedRig(t, f)
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	twin := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	for name, carry := range map[string]func(*rest.Config){
		"CA bytes inline":       func(c *rest.Config) { c.CAData, c.CAFile = f.ca.CertPEM(), "" },
		"rest.LoadTLSFiles":     func(c *rest.Config) { rest.LoadTLSFiles(c) },
		"another file, same CA": func(c *rest.Config) { c.CAFile = twin.ca },
	} {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
			pair := wrapPair(t, p, func() *rest.Config { return d.config(oldServer.srv.URL()) })
			toOld := pair.copies(carry)
			toNew := toOld.copies(func(c *rest.Config) { c.Host = newServer.srv.URL() })
			heldOld := oldServer.hold(t, toOld, &aliceSeen)
			heldNew := newServer.hold(t, toNew, &observation{Err: "unknown authority"})
			d.write(t, f.alice, newCA.CertPEM())
			waitFor(t, "the new CA is taken", func() bool { return p.Stats().Rotations == 1 })
			heldOld.agree(t, &aliceSeen)
			heldNew.agree(t, &observation{Err: "unknown authority"})
		})
	}
}

// rerunEnv marks a child process of rerunWithClientGoGates.
const rerunEnv = "SHAREDTRANSPORT_TEST_RERUN"

// rerunWithClientGoGates runs the top-level test t once more, in a child
// process of the test binary whose environment adds gates, client-go's
// feature gates (KUBE_FEATURE_<name>=<bool>): client-go reads them once per
// process. In that child it does nothing.
func rerunWithClientGoGates(t *testing.T, gates ...string) {
	t.Helper()
	if os.Getenv(rerunEnv) != "" {
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
	cmd.Env = append(append(os.Environ(), rerunEnv+"=1"), gates...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()+" ") {
		t.Errorf("with %v: %v\n%s", gates, err, out)
	}
}

// TestHookIdentityAgainstClientGoKey checks, field by field, what the hook
// relies on (see hook): when client-go's cache hands two configs the same
// transport, the pool gives them the same identity, except for a CA, which
// the hook checks by the roots themselves (trustsAlike). Which CA variants
// client-go keys alike depends on its version and ClientsAllowCARotation:
// the test runs again with the gate off.
func TestHookIdentityAgainstClientGoKey(t *testing.T) {
	rerunWithClientGoGates(t, "KUBE_FEATURE_ClientsAllowCARotation=false")
	f := newFixture(t, testserver.Options{})
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	twin := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	p := newPool(t)
	keyOf := func(cfg *rest.Config) (identityKey, http.RoundTripper) {
		t.Helper()
		s, share, err := sharingFor(cfg, declaration{}, p.opts.dialIdentity, false)
		if err != nil || !share {
			t.Fatalf("%v, share %v", err, share)
		}
		rt, err := clientGoTransport(s.tc)
		must(t, err)
		return s.id.key, rt
	}
	for _, c := range []struct {
		name   string
		ca     bool // the variant differs from the base in its CA only
		change func(*rest.Config)
	}{
		{"CA bytes inline", true, func(c *rest.Config) { c.CAData, c.CAFile = f.ca.CertPEM(), "" }},
		{"CA in another file", true, func(c *rest.Config) { c.CAFile = twin.ca }},
		{"CA file and the same bytes inline", true, func(c *rest.Config) { c.CAData = f.ca.CertPEM() }},
		{"certificate and key inline", false, func(c *rest.Config) {
			c.CertData, c.KeyData, c.CertFile, c.KeyFile = f.alice.CertPEM, f.alice.KeyPEM, "", ""
		}},
		{"certificate inline, key file", false, func(c *rest.Config) { c.CertData, c.CertFile = f.alice.CertPEM, "" }},
		{"certificate and key in other files", false, func(c *rest.Config) { c.CertFile, c.KeyFile = twin.cert, twin.key }},
		{"all files loaded (rest.LoadTLSFiles)", false, func(c *rest.Config) { rest.LoadTLSFiles(c) }},
		{"server name", false, func(c *rest.Config) { c.ServerName = "other.example" }},
		{"next protos", false, func(c *rest.Config) { c.NextProtos = []string{"http/1.1"} }},
		{"compression off", false, func(c *rest.Config) { c.DisableCompression = true }},
		{"insecure instead of a CA", false, func(c *rest.Config) { c.CAFile, c.Insecure = "", true }},
		{"a bearer token", false, func(c *rest.Config) { c.BearerToken = "token-x" }},
		{"another host", false, func(c *rest.Config) { c.Host = "https://other.example:6443" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			baseKey, baseRT := keyOf(d.config(f.srv.URL()))
			v := d.config(f.srv.URL())
			c.change(v)
			key, rt := keyOf(v)
			sameClientGo, sameKey := rt == baseRT, key == baseKey
			t.Logf("client-go's cache hands both the same transport: %v; the pool's identity is the same: %v", sameClientGo, sameKey)
			if c.name == "CA bytes inline" && sameClientGo == caFileByPath() {
				t.Errorf("client-go keys the CA file by its bytes: %v; caFileByPath says by its path: %v", sameClientGo, caFileByPath())
			}
			if sameClientGo && !sameKey && !c.ca {
				t.Errorf("client-go keys this alike and the pool does not: the hook would put such a copy on the wrapped config's identity")
			}
			if sameClientGo && !sameKey {
				// The exception the hook checks by data: same roots today,
				// and the client leaves the shared transport when they change.
				ours := &tls.Config{RootCAs: f.ca.Pool()}
				if !trustsAlike(rt, ours) {
					t.Errorf("client-go's transport for the variant does not trust the CA it carries")
				}
				other, err := testserver.NewCA("other")
				must(t, err)
				ours.RootCAs = other.Pool()
				if trustsAlike(rt, ours) {
					t.Errorf("trustsAlike takes another CA's roots for the variant's")
				}
			}
		})
	}
}

// TestWrapUnwrappedKeepsNothing: clients of a wrapped config unwrapped to
// client-go's transport with utilnet.TLSClientConfig (as apimachinery's
// UpgradeAwareHandler does), then every config and client dropped. From
// v0.36 client-go collects its cached transport once no client has it; the
// pool, its identity released, must not keep it reachable. The control
// runs the same steps through client-go alone first.
func TestWrapUnwrappedKeepsNothing(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	unwrapped := func(cfg *rest.Config) weak.Pointer[tls.Config] {
		hc, err := rest.HTTPClientFor(cfg)
		must(t, err)
		tc, err := utilnet.TLSClientConfig(hc.Transport)
		if err != nil || tc == nil {
			t.Fatalf("%v, %v", tc, err)
		}
		return weak.Make(tc)
	}
	collected := func(w weak.Pointer[tls.Config]) bool {
		for range 50 {
			runtime.GC()
			if w.Value() == nil {
				return true
			}
			time.Sleep(20 * time.Millisecond)
		}
		return false
	}
	alone := collected(unwrapped(f.srv.RestConfig(f.alice)))
	t.Logf("client-go alone collects its cached transport: %v", alone)

	p := newPool(t, WithIdleTimeout(0))
	w := func() weak.Pointer[tls.Config] {
		cfg := f.srv.RestConfig(f.alice)
		must(t, p.Wrap(cfg))
		return unwrapped(cfg)
	}()
	if st := p.Stats(); st.PassThrough != 1 || st.Identities != 1 {
		t.Errorf("pool %+v, want 1 identity and the unwrapped client passed through", st)
	}
	waitReleased(t, p)
	if alone && !collected(w) {
		t.Errorf("client-go's transport stays reachable through the pool, with no identity left")
	}
}

// newMovedRig returns a new CA and a copy rig served from it that still
// trusts f's CA for client certificates: a server whose CA moved.
func newMovedRig(t *testing.T, f *fixture) (*testserver.CA, *copyRig) {
	t.Helper()
	newCA, err := testserver.NewCA("new-ca")
	must(t, err)
	serving, err := newCA.IssueServer()
	must(t, err)
	return newCA, newCopyRig(t, testserver.Options{CA: newCA, ServerCert: serving, ClientCAs: f.ca.Pool()})
}

// TestUnwrapReachesThatClientAlone: two pools wrap configs client-go keys
// alike (Default() and another, say). A wrapper added after Wrap to one
// client of the first pool unwraps its round tripper and repoints the proxy
// of the transport it finds, client-go's cached one: that client goes the
// new way, and the first pool's other clients and the second pool's stay
// on their pools, as the README's rule says.
func TestUnwrapReachesThatClientAlone(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	proxy := newConnectProxy(t)
	u, _ := url.Parse(proxy.url())
	pools := []*Pool{newPool(t), newPool(t)}
	newClient := func(p *Pool, repoint bool) *http.Client {
		cfg := f.srv.RestConfig(f.alice)
		must(t, p.Wrap(cfg))
		if repoint {
			cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
				if found := unwrapToTransport(rt); found != nil {
					found.Proxy = http.ProxyURL(u)
				}
				return rt
			})
		}
		c, err := rest.HTTPClientFor(cfg)
		must(t, err)
		return c
	}
	other, second := newClient(pools[0], false), newClient(pools[1], false)
	repointed := newClient(pools[0], true)
	viaProxy := func(c *http.Client) bool {
		before := proxy.Stats().Tunnels
		c.CloseIdleConnections()
		if _, err := getUA(context.Background(), c, f.srv.URL(), "which way"); err != nil {
			t.Fatal(err)
		}
		return proxy.Stats().Tunnels > before
	}
	for name, tc := range map[string]struct {
		c    *http.Client
		want bool
	}{"the repointed client": {repointed, true}, "another client of its pool": {other, false}, "a client of the second pool": {second, false}} {
		if got := viaProxy(tc.c); got != tc.want {
			t.Errorf("%s: through the proxy %v, want %v", name, got, tc.want)
		}
	}
	if st := pools[1].Stats(); st.PassThrough != 0 {
		t.Errorf("the second pool passed %d clients through, want none", st.PassThrough)
	}
}

// TestWrapTwice: a config wrapped twice, by one pool, has its clients
// share as after one Wrap, and Stats counts no pass-through: the second
// Wrap changes nothing. Its clients' requests come on as many connections
// as client-go alone's (one, once a first request opened it).
func TestWrapTwice(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	accepted := map[bool]uint64{}
	for _, pooled := range []bool{false, true} {
		f.srv.CloseClientConnections()
		waitFor(t, "the server's connections closed", func() bool { return f.srv.OpenConns() == 0 })
		f.srv.ResetStats()
		cfg := f.srv.RestConfig(f.alice)
		p := newPool(t)
		if pooled {
			must(t, p.Wrap(cfg))
			must(t, p.Wrap(cfg))
		}
		for range 3 {
			must(t, listNodes(ctx, cfg))
		}
		accepted[pooled] = f.srv.Stats().Accepted
		st := p.Stats()
		t.Logf("pool %v: 3 clients of a config wrapped twice: %d connections; %+v", pooled, accepted[pooled], st)
		if pooled && (st.PassThrough != 0 || st.Misses != 1 || st.Identities != 1 || st.Dials != accepted[pooled]) {
			t.Errorf("a config wrapped twice: %+v, want one identity, built once, nothing passed through, its dials the server's connections", st)
		}
	}
	if accepted[true] > accepted[false] {
		t.Errorf("a config wrapped twice: %d connections, client-go alone %d", accepted[true], accepted[false])
	}
}
