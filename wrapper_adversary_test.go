package sharedtransport

// Adversarial tests: each is an attack on the promise that a client of a copy of a wrapped config, of the
// config changed in place, or of the config itself, is seen by the server,
// the proxies and the dialers exactly as the same config through client-go
// alone. Every case runs a control through client-go alone.

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestAdversaryExecRotationRemembered: an exec-plugin identity has one
// generation for good (its certificate changes without a rotation of the
// pool), so a client found to agree with the plugin's certificate once rides
// the shared transport after the plugin hands out another one.
func TestAdversaryExecRotationRemembered(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	issue := func(cn string) *testserver.KeyPair {
		kp, err := f.ca.IssueClient(cn)
		must(t, err)
		return kp
	}
	h2 := "HTTP/2.0"

	t.Run("copy with the plugin's certificate inline, plugin rotates", func(t *testing.T) {
		first, next := issue("exec-first"), issue("exec-next")
		exec := writeExecPlugin(t, f.dir, "adv-inline", first)
		expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
		writeExecCredential(t, f.dir, "adv-inline", first, expiry)
		pair := wrapPair(t, newPool(t), func() *rest.Config {
			c := r.srv.RestConfig(nil)
			e := *exec
			c.ExecProvider = &e
			return c
		})
		// A config that holds exec-first's certificate and key itself
		// (client-go's exec authenticator steps aside for it).
		cp := pair.copies(func(c *rest.Config) { c.CertData, c.KeyData = first.CertPEM, first.KeyPEM })
		firstSeen := observation{CN: "exec-first", Proto: h2, Gzip: true, Via: "direct"}
		r.check(t, cp, &firstSeen)
		before := r.hold(t, cp, nil)
		writeExecCredential(t, f.dir, "adv-inline", next, time.Time{})
		time.Sleep(time.Until(expiry) + 200*time.Millisecond)
		// The original's own client runs the plugin again and moves on.
		waitFor(t, "the original presents exec-next", func() bool { return r.observe(pair.wrapped).CN == "exec-next" })
		before.agree(t, nil)
		r.check(t, cp, &firstSeen)
	})

	t.Run("copy with its own plugin, the copy's plugin rotates", func(t *testing.T) {
		shared, own := issue("exec-shared"), issue("exec-own")
		exec := writeExecPlugin(t, f.dir, "adv-orig", shared)
		// The copy's plugin is another program that starts out printing the
		// same credential, and later another one.
		copyExec := writeExecPlugin(t, f.dir, "adv-copy", shared)
		expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
		writeExecCredential(t, f.dir, "adv-copy", shared, expiry)
		pair := wrapPair(t, newPool(t), func() *rest.Config {
			c := r.srv.RestConfig(nil)
			e := *exec
			c.ExecProvider = &e
			return c
		})
		cp := pair.copies(func(c *rest.Config) { e := *copyExec; c.ExecProvider = &e })
		r.check(t, cp, &observation{CN: "exec-shared", Proto: h2, Gzip: true, Via: "direct"})
		writeExecCredential(t, f.dir, "adv-copy", own, time.Time{})
		time.Sleep(time.Until(expiry) + 200*time.Millisecond)
		ownSeen := observation{CN: "exec-own", Proto: h2, Gzip: true, Via: "direct"}
		// The first request after expiry runs the copy's plugin again.
		for range 2 {
			r.check(t, cp, &ownSeen)
		}
	})
}

// TestAdversaryInnerWrapperDropped: a wrapper that lands inside the hook (a
// copy that prepends it: transport.Wrappers(mine, cfg.WrapTransport)) and
// implements utilnet.RoundTripperWrapper, as client-go's own bearer-token and
// impersonation wrappers do, is unwrapped to client-go's *http.Transport and
// then replaced together with it: its headers never reach the server.
func TestAdversaryInnerWrapperDropped(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	h2 := "HTTP/2.0"
	for name, newOriginal := range map[string]func() *rest.Config{
		"inline certificate": func() *rest.Config { return r.srv.RestConfig(f.alice) },
		"certificate files":  func() *rest.Config { return newCertDir(t, inPlace, f.alice, f.ca.CertPEM()).config(r.srv.URL()) },
	} {
		t.Run(name, func(t *testing.T) {
			pair := wrapPair(t, newPool(t), newOriginal)
			cp := pair.copies(func(c *rest.Config) {
				c.WrapTransport = transport.Wrappers(func(rt http.RoundTripper) http.RoundTripper {
					return transport.NewBearerAuthRoundTripper("token-y", rt)
				}, c.WrapTransport)
			})
			r.check(t, cp, &observation{CN: "alice", Token: "token-y", Proto: h2, Gzip: true, Via: "direct"})
			t.Run("set in place after Wrap", func(t *testing.T) {
				for _, c := range []*rest.Config{pair.wrapped, pair.control} {
					c.WrapTransport = transport.Wrappers(func(rt http.RoundTripper) http.RoundTripper {
						return transport.NewBearerAuthRoundTripper("token-x", rt)
					}, c.WrapTransport)
				}
				r.check(t, pair, &observation{CN: "alice", Token: "token-x", Proto: h2, Gzip: true, Via: "direct"})
			})
		})
	}
}

// TestAdversaryProxyPerPath: http.Transport asks Proxy when it dials, and
// client-go hands it the config's Proxy; the pool remembers one answer per
// scheme and host. A Proxy that sends some paths through an (auditing)
// proxy is bypassed once another path to the same host went direct, for the
// wrapped config itself and for copies that set such a Proxy.
func TestAdversaryProxyPerPath(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	proxied, _ := url.Parse(r.proxies[0].url())
	nodesProxied := func(req *http.Request) (*url.URL, error) {
		if strings.HasSuffix(req.URL.Path, "/nodes") {
			return proxied, nil
		}
		return nil, nil
	}
	want := observation{CN: "alice", Proto: "HTTP/2.0", Gzip: true, Via: "proxy 1"}
	run := func(t *testing.T, pair copyPair) {
		t.Helper()
		var got [2]observation
		for i, cfg := range []*rest.Config{pair.wrapped, pair.control} {
			c := r.client(cfg)
			if c.err != nil {
				t.Fatal(c.err)
			}
			// Another path first: direct, by the same function.
			if _, err := c.cs.Discovery().ServerVersion(); err != nil {
				t.Fatal(err)
			}
			got[i] = c.observe()
		}
		if got[0] != got[1] {
			t.Errorf("GET .../nodes after GET /version: through the pool %+v, through client-go alone %+v", got[0], got[1])
		}
		if got[1] != want {
			t.Errorf("control saw %+v, want %+v (the test's premise is wrong)", got[1], want)
		}
	}
	t.Run("the wrapped config's own Proxy", func(t *testing.T) {
		run(t, wrapPair(t, newPool(t), func() *rest.Config {
			c := r.srv.RestConfig(f.alice)
			c.Proxy = nodesProxied
			return c
		}))
	})
	t.Run("a copy's Proxy", func(t *testing.T) {
		pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
		run(t, pair.copies(func(c *rest.Config) { c.Proxy = nodesProxied }))
	})
}

// TestAdversaryExecPluginAtConstruction: client-go runs a copy's exec plugin
// at the first handshake. The hook runs it when the client is built (to read
// the certificate client-go's transport would present), holding the
// identity's check lock, so building an unrelated client of the same
// identity waits for another config's plugin (an interactive login, a slow
// credential service).
func TestAdversaryExecPluginAtConstruction(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	kp, err := f.ca.IssueClient("exec-slow")
	must(t, err)
	exec := writeExecPlugin(t, f.dir, "adv-fast", f.alice)
	slow := writeExecPlugin(t, f.dir, "adv-slow", kp)
	started, release := filepath.Join(f.dir, "adv-slow.started"), filepath.Join(f.dir, "adv-slow.release")
	// The slow plugin says it started, then waits (at most 10 s) for release.
	script := "#!/bin/sh\n: > '" + started + "'\nfor i in $(seq 100); do [ -f '" + release + "' ] && break; sleep 0.1; done\nexec cat '" + filepath.Join(f.dir, "adv-slow.json") + "'\n"
	must(t, os.WriteFile(slow.Command, []byte(script), 0o700))
	t.Cleanup(func() { os.WriteFile(release, nil, 0o600) })

	for _, wrapped := range []bool{false, true} {
		name := map[bool]string{false: "client-go alone", true: "through the pool"}[wrapped]
		t.Run(name, func(t *testing.T) {
			os.Remove(started)
			os.Remove(release)
			orig := r.srv.RestConfig(nil)
			e := *exec
			orig.ExecProvider = &e
			if wrapped {
				must(t, newPool(t).Wrap(orig))
			}
			slowCopy := rest.CopyConfig(orig)
			s := *slow
			slowCopy.ExecProvider = &s
			slowBuilt := make(chan error, 1)
			go func() {
				_, err := kubernetes.NewForConfig(slowCopy)
				slowBuilt <- err
			}()
			slowDone := false
			select {
			case err := <-slowBuilt:
				must(t, err)
				slowDone = true
			case <-time.After(2 * time.Second):
			}
			if _, err := os.Stat(started); err == nil {
				t.Errorf("building a client (no request sent) ran its exec plugin; client-go runs it at the first handshake")
			}
			// Another copy of the same identity (a token) is built while the
			// slow plugin is held.
			tokenCopy := rest.CopyConfig(orig)
			tokenCopy.BearerToken = "token-x"
			built := make(chan error, 1)
			go func() {
				_, err := kubernetes.NewForConfig(tokenCopy)
				built <- err
			}()
			tokenDone := false
			select {
			case err := <-built:
				must(t, err)
				tokenDone = true
			case <-time.After(3 * time.Second):
				t.Errorf("building a client of another copy waited for the slow copy's exec plugin")
			}
			os.WriteFile(release, nil, 0o600)
			for ch, done := range map[chan error]bool{slowBuilt: slowDone, built: tokenDone} {
				if done {
					continue
				}
				select {
				case <-ch:
				case <-time.After(15 * time.Second):
					t.Fatal("a client was never built")
				}
			}
		})
	}
}

// TestAdversaryProxyErrorPassword: a config whose Proxy fails passes
// through, and TransportFor logs why (V(2)), the function's error among it.
// A Proxy that parses a configured proxy address (url.Parse of a flag or a
// setting) fails with a *url.Error that quotes the whole address, password
// included.
// client-go alone logs nothing then: it returns the error to the caller of
// the request.
func TestAdversaryProxyErrorPassword(t *testing.T) {
	logs := captureKlog(t, 10)
	const password = "pr0xy-S3cret"
	configured := "http://user:" + password + "@proxy.example:port" // a typo in the port
	cfg := &rest.Config{Host: "https://api.example:6443", Proxy: func(*http.Request) (*url.URL, error) { return url.Parse(configured) }}
	cfg.Insecure = true
	if _, err := cfg.Proxy(&http.Request{URL: &url.URL{Scheme: "https", Host: "api.example:6443"}}); err == nil {
		t.Fatal("the Proxy function does not fail (the test's premise is wrong)")
	}
	// Wrap passes a config with a Proxy through without asking it;
	// TransportFor asks it, and logs why the config passes through.
	p := newPool(t)
	if err := p.Wrap(cfg); err != nil {
		mustNoSecret(t, "Wrap's error", err.Error(), password)
	}
	if _, err := p.TransportFor(cfg); err != nil {
		mustNoSecret(t, "TransportFor's error", err.Error(), password)
	}
	if st := p.Stats(); st.PassThrough != 2 {
		t.Fatalf("%d configs passed through, want 2 (the test's premise is wrong)", st.PassThrough)
	}
	mustNoSecretLogged(t, logs, password)
	if !strings.Contains(logs.String(), "its Proxy function failed") {
		t.Errorf("TransportFor logged nothing about the failed Proxy (the test's premise is wrong):\n%s", logs)
	}
}

// TestAdversaryDisableHTTP2AfterWrap: the ALPN a client-go transport must
// offer is fixed at Wrap (identity.nextProtos), while each new generation is built
// with utilnet.SetTransportDefaults, which reads DISABLE_HTTP2 again. After
// the variable changes and the files rotate, clients whose client-go
// transport speaks HTTP/2 are moved to a generation that speaks HTTP/1.1.
// With the protocols named in the config, the new generation offers the
// same list (h2 included) without speaking HTTP/2: equal lists are not
// enough, and such a client would fail where client-go alone speaks HTTP/2.
func TestAdversaryDisableHTTP2AfterWrap(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	for _, nextProtos := range [][]string{nil, {"h2", "http/1.1"}} {
		t.Run(fmt.Sprintf("NextProtos=%q", nextProtos), func(t *testing.T) {
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
			pair := wrapPair(t, p, func() *rest.Config {
				c := d.config(r.srv.URL())
				c.NextProtos = nextProtos
				return c
			})
			before := r.hold(t, pair, nil)
			for _, c := range before {
				if o := c.observe(); o.Proto != "HTTP/2.0" || o.CN != "alice" {
					t.Fatalf("before: %+v", o)
				}
			}
			t.Setenv("DISABLE_HTTP2", "true")
			d.write(t, f.bob, f.ca.CertPEM())
			waitFor(t, "rotation to bob", func() bool { return p.Stats().Rotations == 1 })
			time.Sleep(certSettle)
			before.agree(t, nil)
			if nextProtos == nil {
				// With h2 in the list and HTTP/2 off, client-go alone fails
				// too: a new client has nothing to compare with.
				r.check(t, pair, nil)
			}
		})
	}
}

// TestAdversaryClientGoTransportCreated: Wrap of a config client-go caches
// asks client-go's cache for the config's transport, which client-go builds
// (and, before v0.36, keeps for good) with a certificate-refresher goroutine
// for certificate files: the one any client of the config starts. A client
// of a copy client-go cannot cache (a Proxy) starts no more of them through
// the pool than through client-go alone.
func TestAdversaryClientGoTransportCreated(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	// refreshers returns the goroutine IDs of the refreshers running: IDs
	// are never reused, so those not seen before were started since, however
	// many of earlier tests' refreshers ended meanwhile.
	refreshers := func() map[string]bool {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		for ; n == len(buf); n = runtime.Stack(buf, true) { // cut short: the newest goroutines come last
			buf = make([]byte, 2*len(buf))
		}
		ids := map[string]bool{}
		for _, g := range strings.Split(string(buf[:n]), "\n\n") {
			// Run before client-go v0.36, run from it.
			if strings.Contains(g, "transport.(*dynamicClientCert).Run(") || strings.Contains(g, "transport.(*dynamicClientCert).run(") {
				ids[strings.Fields(g)[1]] = true // "goroutine ID [state]:"
			}
		}
		return ids
	}
	var started [2]int
	for i, wrapped := range []bool{false, true} {
		d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
		orig := d.config(r.srv.URL())
		if wrapped {
			must(t, newPool(t).Wrap(orig))
		}
		time.Sleep(100 * time.Millisecond) // let Wrap's goroutines show in the dump
		before := refreshers()
		cp := rest.CopyConfig(orig)
		cp.Proxy = proxyTo(r.proxies[0])
		c := r.client(cp)
		if o := c.observe(); o.CN != "alice" || o.Via != "proxy 1" {
			t.Fatalf("wrapped %v: %+v", wrapped, o)
		}
		time.Sleep(100 * time.Millisecond) // let started goroutines show in the dump
		for id := range refreshers() {
			if !before[id] {
				started[i]++
			}
		}
		runtime.KeepAlive(c) // from v0.36 a refresher ends with its transport
	}
	if started[1] != started[0] {
		t.Errorf("a client of a copy with Proxy started %d certificate refreshers through the pool, %d through client-go alone", started[1], started[0])
	}
	if started[0] == 0 {
		t.Error("the control started no certificate refresher: the test sees none")
	}
	t.Logf("a client of a copy with Proxy started %d certificate refreshers through the pool, %d through client-go alone", started[1], started[0])
}

// TestAdversaryFirstRequestGate: a generation serves every host its
// clients talk to (the host is not identity), so a request of a copy
// pointed at a host that does not answer must hold up none of the
// original's requests to a healthy server, at Wrap or after a rotation: no
// request waits on another's dial or response, as with client-go alone.
func TestAdversaryFirstRequestGate(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	// A host that accepts connections and never answers.
	addr, accepted, release := holdingListener(t)

	for _, wrapped := range []bool{false, true} {
		name := map[bool]string{false: "client-go alone", true: "through the pool"}[wrapped]
		t.Run(name, func(t *testing.T) {
			orig := r.srv.RestConfig(f.alice)
			if wrapped {
				must(t, newPool(t).Wrap(orig))
			}
			dead := rest.CopyConfig(orig)
			dead.Host = "https://" + addr
			deadCS, err := kubernetes.NewForConfig(dead)
			must(t, err)
			deadCtx, stopDead := context.WithCancel(context.Background())
			defer stopDead()
			deadDone := make(chan struct{})
			before := accepted()
			go func() {
				defer close(deadDone)
				deadCS.Discovery().RESTClient().Get().AbsPath("/version").Do(deadCtx) // ends when cancelled
			}()
			waitFor(t, "the copy's dial of its host", func() bool { return accepted() > before })
			c := r.client(orig)
			if c.err != nil {
				t.Fatal(c.err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			_, err = c.cs.Discovery().RESTClient().Get().AbsPath("/version").Do(ctx).Raw()
			if err != nil {
				t.Errorf("the original's request to a healthy server, while a copy's first request to a host that does not answer is in flight: %v", err)
			}
			stopDead()
			release()
			<-deadDone
		})
	}
}

// TestAdversaryCopyProxyWithNoProxyCIDR: in a process whose NO_PROXY names
// a CIDR (common in clusters: NO_PROXY=10.0.0.0/8,...), client-go's proxy
// function for configs without Proxy is the closure
// utilnet.NewProxierWithNoProxyCIDR returns. A copy that sets its own Proxy
// the same way (the usual way to give a proxy function NO_PROXY's CIDR
// handling) gets a function with the same code: a hook that tells "routes by
// the environment" by the code pointer alone sends the copy's requests
// direct, where client-go sends them through the copy's proxy.
func TestAdversaryCopyProxyWithNoProxyCIDR(t *testing.T) {
	const child = "SHAREDTRANSPORT_TEST_NO_PROXY_CHILD"
	if os.Getenv(child) == "" {
		// NO_PROXY is read when the package initialises: a process of its
		// own, with a CIDR that leaves loopback to the proxies.
		cmd := exec.Command(os.Args[0], "-test.run=^TestAdversaryCopyProxyWithNoProxyCIDR$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), child+"=1", "NO_PROXY=10.0.0.0/8", "no_proxy=", "HTTPS_PROXY=", "https_proxy=")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestAdversaryCopyProxyWithNoProxyCIDR") {
			t.Fatalf("in a process with NO_PROXY=10.0.0.0/8: %v\n%s", err, out)
		}
		return
	}
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	r.check(t, pair, &observation{CN: "alice", Proto: "HTTP/2.0", Gzip: true, Via: "direct"})
	cp := pair.copies(func(c *rest.Config) { c.Proxy = utilnet.NewProxierWithNoProxyCIDR(proxyTo(r.proxies[1])) })
	r.check(t, cp, &observation{CN: "alice", Proto: "HTTP/2.0", Gzip: true, Via: "proxy 2"})
}

// TestAdversaryOwnTransportSettings: a copy handed a transport of its own
// (cfg.Transport: client-go's transport for the same identity, cloned, with
// one setting client-go never makes) keeps it. The dialer, roots and
// certificate match the pool's, but the pool's connections would not do
// what that setting does: log TLS keys, refuse long response headers, or
// hand HTTP/2 connections to a function of its own (which here adds a token:
// the server authenticates the copy's requests as another user).
func TestAdversaryOwnTransportSettings(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	for name, set := range map[string]func(*http.Transport, *strings.Builder){
		"TLS key log":           func(t *http.Transport, log *strings.Builder) { t.TLSClientConfig.KeyLogWriter = log },
		"response header limit": func(t *http.Transport, _ *strings.Builder) { t.MaxResponseHeaderBytes = 10 },
		"HTTP/2 of its own": func(t *http.Transport, _ *strings.Builder) {
			// Where HTTP/2 is net/http's own (Go 1.27 with x/net v0.63),
			// its handler is registered at first use, which this is.
			t.CloseIdleConnections()
			up := t.TLSNextProto["h2"]
			if up == nil {
				panic(fmt.Sprintf("no HTTP/2 handler to wrap in %v", slices.Collect(maps.Keys(t.TLSNextProto))))
			}
			t.TLSNextProto["h2"] = func(authority string, c *tls.Conn) http.RoundTripper {
				return transport.NewBearerAuthRoundTripper("token-y", up(authority, c))
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			orig := r.srv.RestConfig(f.alice)
			tc, err := rest.CopyConfig(orig).TransportConfig()
			must(t, err)
			rt, err := transport.New(tc)
			must(t, err)
			// From v0.36 client-go hands it out inside a holder of its own.
			clientGo := unwrapToTransport(rt)
			if clientGo == nil {
				t.Fatalf("client-go's transport for the config is a %T", rt)
			}
			own := clientGo.Clone()
			var keyLog strings.Builder
			set(own, &keyLog)
			withOwn := func(c *rest.Config) *rest.Config {
				c = rest.CopyConfig(c)
				c.TLSClientConfig = rest.TLSClientConfig{}
				c.Transport = own
				return c
			}
			control := r.observe(withOwn(orig))
			loggedAlone := keyLog.Len()

			must(t, newPool(t).Wrap(orig))
			got := r.observe(withOwn(orig))
			if got != control {
				t.Errorf("through the pool the server saw %+v; through client-go alone %+v", got, control)
			}
			if loggedAlone > 0 && keyLog.Len() == loggedAlone {
				t.Errorf("the copy's key log got nothing through the pool (%d bytes through client-go alone): its requests rode the pool's connections", loggedAlone)
			}
		})
	}
}

// TestAdversaryCopyProxyCredentials: a copy whose Proxy names the same proxy
// with other credentials keeps its own: the proxy that refuses them refuses
// the copy, as it does through client-go alone, and the original's
// credentials never carry the copy's requests.
func TestAdversaryCopyProxyCredentials(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	basic := func(user, password string) string {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	}
	proxy := newAuthProxy(t, basic("alice", "alice-pw"))
	as := func(user, password string) func(*http.Request) (*url.URL, error) {
		u, err := url.Parse(proxy.url())
		must(t, err)
		u.User = url.UserPassword(user, password)
		return http.ProxyURL(u)
	}
	orig := r.srv.RestConfig(f.alice)
	orig.Proxy = as("alice", "alice-pw")
	other := func(c *rest.Config) *rest.Config {
		c = rest.CopyConfig(c)
		c.Proxy = as("mallory", "guess")
		return c
	}
	control := r.observe(other(orig))
	if control.Err == "" {
		t.Fatalf("through client-go alone the proxy let the copy's credentials through: %+v", control)
	}
	must(t, newPool(t).Wrap(orig))
	if got := r.observe(orig); got.Err != "" {
		t.Fatalf("the original through the pool: %+v", got)
	}
	if got := r.observe(other(orig)); got != control {
		t.Errorf("the copy with other proxy credentials: through the pool %+v; through client-go alone %+v", got, control)
	}
}

// TestAdversaryCopyExecOverInline: the original holds alice's certificate
// inline; a copy drops it for an exec plugin that prints alice's certificate
// too, for now. The copy's transport presents alice's bytes when the hook
// compares, so it rides the shared transport; once the plugin hands out
// bob's certificate, client-go alone presents bob (its exec authenticator
// closes its connections), and the pool must not keep presenting alice.
func TestAdversaryCopyExecOverInline(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	exec := writeExecPlugin(t, f.dir, "atk-inline", f.alice)
	expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
	writeExecCredential(t, f.dir, "atk-inline", f.alice, expiry)
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	cp := pair.copies(func(c *rest.Config) {
		c.CertData, c.KeyData = nil, nil
		e := *exec
		c.ExecProvider = &e
	})
	before := r.hold(t, cp, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
	writeExecCredential(t, f.dir, "atk-inline", f.bob, time.Time{})
	time.Sleep(time.Until(expiry) + 200*time.Millisecond)
	bobSeen := observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}
	for range 2 {
		before.agree(t, &bobSeen)
	}
	r.check(t, cp, &bobSeen)
}

// TestAdversaryTransportForProxyPerPath: TestAdversaryProxyPerPath for
// TransportFor. http.Transport asks the config's Proxy when it dials, and
// every request here starts on a new connection: each goes where the
// function sends it, never by the answer it gave for the identity's sample
// request. TestTransportForAsksProxyPerRequest covers every request.
func TestAdversaryTransportForProxyPerPath(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	proxy := newConnectProxy(t)
	proxyURL, _ := url.Parse(proxy.url())
	for _, tc := range []struct {
		name  string
		proxy func(*http.Request) (*url.URL, error)
	}{
		{"nodes through the proxy, the rest direct", func(req *http.Request) (*url.URL, error) {
			if strings.HasSuffix(req.URL.Path, "/nodes") {
				return proxyURL, nil
			}
			return nil, nil
		}},
		{"nodes direct, the rest through the proxy", func(req *http.Request) (*url.URL, error) {
			if strings.HasSuffix(req.URL.Path, "/nodes") {
				return nil, nil
			}
			return proxyURL, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t)
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = tc.proxy
			vias := map[string][]string{}
			for name, newRT := range map[string]func(*rest.Config) (http.RoundTripper, error){"pool": transportForFn(p), "client-go": rest.TransportFor} {
				rt, err := newRT(rest.CopyConfig(cfg))
				must(t, err)
				for _, path := range []string{"/version", "/api/v1/nodes", "/version", "/api/v1/nodes"} {
					// A new connection each time: HTTP/2 reuses a connection
					// to the host whatever the proxy says.
					utilnet.CloseIdleConnectionsFor(rt)
					if code, err := getVia(rt, f.srv.URL()+path); err != nil || code >= 500 {
						t.Fatalf("%s %s: %d %v", name, path, code, err)
					}
					ri, ok := f.srv.LastRequest(path)
					if !ok {
						t.Fatalf("%s %s: the server saw no request", name, path)
					}
					via := "direct"
					if _, ok := proxy.Carried(ri.RemoteAddr, f.srv.Addr()); ok {
						via = "proxy"
					}
					vias[name] = append(vias[name], path+" "+via)
				}
			}
			if strings.Join(vias["pool"], ", ") != strings.Join(vias["client-go"], ", ") {
				t.Errorf("through the pool: %v; through client-go alone: %v", vias["pool"], vias["client-go"])
			}
		})
	}
}

// TestAdversaryInnerWrapperOwnCertificate: a copy prepends a wrapper (inside
// the hook) that hands client-go's transport a GetClientCertificate of its
// own: alice's certificate now, bob's later. The hook asks it once, finds
// alice's bytes, and remembers the match for the generation (an inline
// identity has one for good): after the wrapper's function hands out bob,
// client-go alone presents bob and the pool must not present alice.
func TestAdversaryInnerWrapperOwnCertificate(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	alice, err := f.alice.TLSCertificate()
	must(t, err)
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	var current atomic.Pointer[tls.Certificate]
	current.Store(&alice)
	pair := wrapPair(t, newPool(t), func() *rest.Config { return r.srv.RestConfig(f.alice) })
	cp := pair.copies(func(c *rest.Config) {
		c.CertData, c.KeyData = nil, nil
		c.WrapTransport = transport.Wrappers(func(rt http.RoundTripper) http.RoundTripper {
			// client-go v0.36+ hands wrappers its transport inside holders.
			t := unwrapToTransport(rt)
			if t == nil {
				return rt
			}
			t = t.Clone()
			t.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return current.Load(), nil }
			return t
		}, c.WrapTransport)
	})
	before := r.hold(t, cp, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
	current.Store(&bob)
	// The clone's HTTP/2 connections live in the pool of the transport it
	// was cloned from, which closing the clone's idle connections does not
	// reach: the server closes them, so every client handshakes again.
	r.srv.CloseClientConnections()
	before.agree(t, &observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"})
}

// TestAdversaryOuterWrapperUnwraps: a wrapper added after Wrap (above the
// hook) that finds the *http.Transport below it the way client-go's own
// helpers do (through utilnet.RoundTripperWrapper), clones it and sends the
// clone through another proxy. Above the hook it finds the pool's shared
// transport, and its clone keeps what the pool's generation presented when
// the client was built.
func TestAdversaryOuterWrapperUnwraps(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	proxy2 := proxyTo(r.proxies[1])
	unwrapAndProxy := func(rt http.RoundTripper) http.RoundTripper {
		inner := rt
		for range 8 {
			if t, ok := inner.(*http.Transport); ok {
				t = t.Clone()
				t.Proxy = proxy2
				return t
			}
			w, ok := inner.(utilnet.RoundTripperWrapper)
			if !ok {
				break
			}
			inner = w.WrappedRoundTripper()
		}
		return rt
	}
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair := wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
	cp := pair.copies(func(c *rest.Config) { c.Wrap(unwrapAndProxy) })
	before := r.hold(t, cp, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 2"})
	d.write(t, f.bob, f.ca.CertPEM())
	waitFor(t, "rotation to bob", func() bool { return p.Stats().Rotations == 1 })
	r.checkAfterFileCache(t, before, cp, observation{CN: "bob", Proto: h2, Gzip: true, Via: "proxy 2"})
}

// TestAdversaryClientGoCertificateHolder: TestAdversaryInnerWrapperOwnCertificate
// spelled with client-go's own helper. A copy presents a certificate through a
// transport.GetCertHolder of its own (alice's certificate now, bob's later),
// handed to client-go's transport.TLSConfigFor: by a wrapper inside the hook,
// or in a transport of the copy's own built by transport.New. The certificate
// function is then client-go's (TLSConfigFor's closure), but what it presents
// is the holder's, which may change at any handshake: a match with alice's
// bytes proves nothing for later. A copy of an exec plugin's config whose
// wrapper does the same keeps the plugin's tracked dialer, and the pool took
// the plugin's certificate for what it presents without asking.
func TestAdversaryClientGoCertificateHolder(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	alice, err := f.alice.TLSCertificate()
	must(t, err)
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	var current atomic.Pointer[tls.Certificate]
	holder := &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return current.Load(), nil }}
	byHolder, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{GetCertHolder: holder}})
	must(t, err)
	holderInside := func(c *rest.Config) {
		c.CertData, c.KeyData = nil, nil
		c.WrapTransport = transport.Wrappers(func(rt http.RoundTripper) http.RoundTripper {
			t := unwrapToTransport(rt)
			if t == nil {
				return rt
			}
			t = t.Clone()
			t.TLSClientConfig.GetClientCertificate = byHolder.GetClientCertificate
			return t
		}, c.WrapTransport)
	}
	exec := writeExecPlugin(t, f.dir, "atk-holder", f.alice)
	for _, tc := range []struct {
		name        string
		newOriginal func() *rest.Config
		mutate      func(*rest.Config)
	}{
		{"a wrapper inside the hook", func() *rest.Config { return r.srv.RestConfig(f.alice) }, holderInside},
		{"a wrapper inside the hook, exec plugin", func() *rest.Config {
			c := r.srv.RestConfig(nil)
			e := *exec
			c.ExecProvider = &e
			return c
		}, holderInside},
		{"the copy's own transport", func() *rest.Config { return r.srv.RestConfig(f.alice) }, func(c *rest.Config) {
			own, err := transport.New(&transport.Config{TLS: transport.TLSConfig{CAData: c.CAData, GetCertHolder: holder}})
			must(t, err)
			c.TLSClientConfig = rest.TLSClientConfig{}
			c.Transport = own
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			current.Store(&alice)
			pair := wrapPair(t, newPool(t), tc.newOriginal)
			cp := pair.copies(tc.mutate)
			before := r.hold(t, cp, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
			current.Store(&bob)
			// Every client handshakes again.
			r.srv.CloseClientConnections()
			before.agree(t, &observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"})
		})
	}
}

// TestAdversaryProxyTokenAsUserName: a proxy that takes its credential as the
// user name of the proxy URL (http://TOKEN@proxy, or http://APIKEY:@proxy
// with an empty password, as some hosted proxies want it). url.Redacted
// hides a password only, so the pool's redaction printed the credential in
// Identities (documented as safe to export as metrics) and in its logs.
// client-go alone prints neither.
func TestAdversaryProxyTokenAsUserName(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	const token = "pr0xy-T0ken"
	for _, userInfo := range []string{token, token + ":"} {
		t.Run(userInfo, func(t *testing.T) {
			logs := captureKlog(t, 10)
			proxyURL, err := url.Parse("http://" + userInfo + "@127.0.0.1:3128")
			must(t, err)
			p := newPool(t)
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = http.ProxyURL(proxyURL)
			rt, err := p.TransportFor(cfg)
			must(t, err)
			// A config whose Proxy fails passes through, and its Host is
			// logged; Wrap passes a config with a Proxy through, and logs
			// its Host too.
			failing := f.srv.RestConfig(f.alice)
			failing.Host = "https://" + userInfo + "@" + strings.TrimPrefix(failing.Host, "https://")
			failing.Proxy = func(*http.Request) (*url.URL, error) { return nil, fmt.Errorf("no route") }
			if _, err := p.TransportFor(failing); err != nil {
				t.Fatal(err)
			}
			must(t, p.Wrap(failing))
			identities := fmt.Sprintf("%+v", p.Identities())
			runtime.KeepAlive(rt)
			if !strings.Contains(identities, "127.0.0.1:3128") {
				t.Fatalf("Identities names no proxy (the test's premise is wrong): %s", identities)
			}
			mustNoSecret(t, "Identities", identities, token)
			mustNoSecretLogged(t, logs, token)
		})
	}
}

// TestAdversaryWrapperChangesTLSInPlace: a wrapper in the original's
// WrapTransport (set before Wrap) that changes the TLS configuration of the
// *http.Transport it is handed, in place (here a certificate of its own; a
// debugging key log, a CA added to the roots, are the same). Wrap never runs
// wrappers to find out what they do: undeclared, the config passes through,
// and the wrapper changes client-go's transport as without the pool. Above
// the hook, the wrapper that type-asserts is handed the pool's round
// tripper and does nothing; the one that unwraps changes client-go's
// transport after the hook found it to be the identity's own (certificate
// files: client-go's cached transport for them).
func TestAdversaryWrapperChangesTLSInPlace(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	asBob := func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &bob, nil }
	finds := map[string]func(http.RoundTripper) *http.Transport{
		"type assertion": func(rt http.RoundTripper) *http.Transport { t, _ := rt.(*http.Transport); return t },
		"unwrapping":     unwrapToTransport,
	}
	for name, change := range map[string]func(*http.Transport){
		"unchecked": func(t *http.Transport) { t.TLSClientConfig.GetClientCertificate = asBob },
		"checked": func(t *http.Transport) {
			if t.TLSClientConfig != nil {
				t.TLSClientConfig.GetClientCertificate = asBob
			}
		},
	} {
		for how, find := range finds {
			for _, files := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s, %s, files %v", name, how, files), func(t *testing.T) {
					// A certificate of the subtest's own: the wrapper changes
					// client-go's cached transport for it, for good.
					kp, err := f.ca.IssueClient("alice")
					must(t, err)
					config := func() *rest.Config {
						if files {
							return newCertDir(t, renameOver, kp, f.ca.CertPEM()).config(r.srv.URL())
						}
						return r.srv.RestConfig(kp)
					}
					pair := wrapPair(t, newPool(t), func() *rest.Config {
						c := config()
						c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
							if t := find(rt); t != nil {
								change(t)
							}
							return rt
						}
						return c
					})
					want := observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"}
					if how == "type assertion" && !clientGoHandsTransport(t, config()) {
						want.CN = "alice" // the wrapper finds nothing to change through client-go alone either
					}
					r.check(t, pair, &want)
				})
			}
		}
	}
}

// clientGoHandsTransport reports whether client-go hands WrapTransport an
// *http.Transport for cfg: before v0.36 it always does; from v0.36 some
// configs' transports come inside a holder of its own.
func clientGoHandsTransport(t *testing.T, cfg *rest.Config) bool {
	t.Helper()
	var handed bool
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		_, handed = rt.(*http.Transport)
		return rt
	}
	if _, err := rest.TransportFor(cfg); err != nil {
		t.Fatal(err)
	}
	return handed
}

// TestAdversaryOuterWrapperChangesInPlace: TestAdversaryOuterWrapperUnwraps
// with a wrapper that changes the transport it finds in place instead of
// cloning it (here its certificate). Above the hook it unwraps the pool's
// round tripper to client-go's transport and changes that, after the hook
// found it to be client-go's cached transport for the identity's files: the
// finding, remembered for the generation, is never made again.
func TestAdversaryOuterWrapperChangesInPlace(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	kp, err := f.ca.IssueClient("alice") // client-go's cached transport for it is changed for good
	must(t, err)
	pair := wrapPair(t, newPool(t), func() *rest.Config {
		return newCertDir(t, renameOver, kp, f.ca.CertPEM()).config(r.srv.URL())
	})
	cp := pair.copies(func(c *rest.Config) {
		c.Wrap(func(rt http.RoundTripper) http.RoundTripper {
			if t := unwrapToTransport(rt); t != nil {
				t.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &bob, nil }
			}
			return rt
		})
	})
	r.check(t, cp, &observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"})
}

// TestAdversaryCopyOtherCAFile: a copy names another CA file holding the
// identity's roots. From v0.36 client-go re-reads a CA file on its own
// schedule (every five minutes), so roots alike today prove nothing for
// later, when that file may hold others: the copy keeps client-go's
// transport. Before v0.36 client-go reads the file once, for good, and the
// copy rides the shared transport.
func TestAdversaryCopyOtherCAFile(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	p := newPool(t, WithPollInterval(0))
	_, other, pair := filesPairWithTwin(t, f, r, p)
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	r.check(t, pair, &aliceSeen)
	if n := p.Stats().PassThrough; n != 0 {
		t.Fatalf("the original passed through (%d): the test's premise is wrong", n)
	}
	cp := pair.copies(func(c *rest.Config) { c.CAFile = other.ca })
	r.check(t, cp, &aliceSeen)

	tc, err := rest.CopyConfig(cp.control).TransportConfig()
	must(t, err)
	rt, err := transport.New(tc)
	must(t, err)
	// client-go's own type for a transport whose roots it re-reads, under
	// the layers client-go may put above it.
	rereads := false
	for range 8 {
		rereads = rereads || strings.Contains(fmt.Sprintf("%T", rt), "atomicTransportHolder")
		w, ok := rt.(utilnet.RoundTripperWrapper)
		if !ok {
			break
		}
		rt = w.WrappedRoundTripper()
	}
	want := uint64(0)
	if rereads {
		want = 1
	}
	if got := p.Stats().PassThrough; got != want {
		t.Errorf("client-go re-reads the copy's CA file: %v; %d clients passed through, want %d", rereads, got, want)
	}
}

// TestAdversaryCopyCertChain: a copy of a config with Proxy presents the
// same leaf with the intermediate added or removed. The server trusts only
// the root, so the chain decides whether the client authenticates: each
// copy must meet what it meets through client-go alone, never the
// original's chain.
func TestAdversaryCopyCertChain(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	interKP, err := f.ca.Issue(testserver.CertSpec{CommonName: "intermediate", CA: true})
	must(t, err)
	interKey, err := tls.X509KeyPair(interKP.CertPEM, interKP.KeyPEM)
	must(t, err)
	inter := &testserver.CA{Cert: interKP.Cert, Key: interKey.PrivateKey.(*ecdsa.PrivateKey)}
	kp, err := inter.IssueClient("alice")
	must(t, err)
	leafOnly := kp.CertPEM
	withIntermediate := slices.Concat(kp.CertPEM, interKP.CertPEM)
	for _, c := range []struct {
		name           string
		original, copy []byte
		want           observation // the copy through client-go alone
	}{
		{"intermediate removed", withIntermediate, leafOnly, observation{Err: "error"}}, // the server: unknown certificate authority
		{"intermediate added", leafOnly, withIntermediate, observation{CN: "alice", Proto: h2, Gzip: true, Via: "proxy 1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			pair := wrapPair(t, newPool(t), func() *rest.Config {
				cfg := r.srv.RestConfig(nil)
				cfg.CertData, cfg.KeyData = c.original, kp.KeyPEM
				cfg.Proxy = proxyTo(r.proxies[0])
				return cfg
			})
			r.check(t, pair, nil)
			r.check(t, pair.copies(func(cfg *rest.Config) { cfg.CertData = c.copy }), &c.want)
		})
	}
}

// TestAdversaryRejectedCAFile: a config client-go caches (no Proxy), its CA
// from a file, wrapped and used; then the CA file is emptied, or replaced
// by another CA with a torn block after it, or by an expired CA. The pool
// rejects the file and keeps the old CA for its connections, but a client
// built now from the wrapped config meets the file as client-go alone
// meets it: it does not ride the material the pool rejected.
func TestAdversaryRejectedCAFile(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	other, err := testserver.NewCA("other-ca")
	must(t, err)
	expired, err := testserver.SelfSigned(testserver.CertSpec{CommonName: "expired-ca", CA: true,
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-24 * time.Hour)})
	must(t, err)
	for _, c := range []struct {
		name string
		ca   []byte
	}{
		{"emptied", nil},
		{"another CA and a torn block", slices.Concat(other.CertPEM(), []byte("-----BEGIN CERTIFICATE-----\nMIIB"))},
		{"an expired CA", expired.CertPEM},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
			pair := wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
			r.check(t, pair, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
			writeAtomic(t, d.ca, c.ca)
			waitFor(t, "the CA file rejected", func() bool { return p.Stats().RotationErrors > 0 })
			// client-go before v0.36 reads the file for every new client
			// and fails; later versions re-read it on their own schedule.
			passed := p.Stats().PassThrough
			got, control := r.observe(pair.wrapped), r.observe(pair.control)
			if got != control {
				t.Errorf("a client built now: through the pool %+v, through client-go alone %+v", got, control)
			}
			// In every client-go version the client keeps client-go's
			// transport, even where client-go's cache hands the hook the
			// transport it holds for the wrapped config (v0.36 and later
			// key the cache by the file's path).
			if n := p.Stats().PassThrough - passed; n != 1 {
				t.Errorf("a client built while the pool rejects the CA file: %d passed through, want 1", n)
			}
		})
	}
}

// TestAdversaryCopyOldCAAfterRotation: a config client-go caches, its CA from
// a file, wrapped; the file moves to a new CA. The first client built after
// that is a copy that keeps the file's path and sets the old CA's bytes
// inline. client-go (before v0.36) keys its cache by the CA's bytes and the
// path, so it hands the hook the very transport it held for the wrapped
// config before the rotation; the copy trusts the old CA, as the control
// shows, and must not ride the pool's new one.
func TestAdversaryCopyOldCAAfterRotation(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	// Served from the new CA; client certificates still from the old.
	newCA, moved := newMovedRig(t, f)
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	pair := wrapPair(t, p, func() *rest.Config { return d.config(moved.srv.URL()) })
	moved.check(t, pair, &observation{Err: "unknown authority"})
	settleClientGoReloaders()
	d.write(t, f.alice, newCA.CertPEM())
	waitFor(t, "the new CA is taken", func() bool { return p.Stats().Rotations == 1 })
	oldInline := pair.copies(func(c *rest.Config) { c.CAData = f.ca.CertPEM() })
	moved.check(t, oldInline, &observation{Err: "unknown authority"})
}
