package sharedtransport

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestIsolation: configs that differ in any identity field never share a
// transport or a connection; configs that differ only in per-request
// credentials, user agent or host always share the transport. The server
// checks, for every request, that the client certificate on the connection is
// the one the sending config holds (the config names it in its User-Agent).
func TestIsolation(t *testing.T) {
	ledger := newConnLedger()
	f := newFixture(t, testserver.Options{
		Tokens:    map[string]string{"token-a": "a", "token-b": "b"},
		OnRequest: ledger.onRequest,
	})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	issue := func(cn string) *testserver.KeyPair {
		kp, err := f.ca.IssueClient(cn)
		must(t, err)
		return kp
	}
	aliceReissued := issueForKey(t, f.ca, "alice-reissued", f.alice) // other certificate, same key
	alicePKCS8 := pkcs8(t, f.alice)                                  // same key, other bytes
	execAlice := writeExecPlugin(t, f.dir, "exec-alice", issue("exec-alice"))
	execBob := writeExecPlugin(t, f.dir, "exec-bob", issue("exec-bob"))
	alicePaths := f.kubeconfig(t, "alice", f.alice)
	proxy1, proxy2 := newConnectProxy(t), newConnectProxy(t)
	relay1, relay2 := newRelay(t, f.srv.Addr()), newRelay(t, f.srv.Addr())

	k := &isolationKit{f: f}
	alice, withCert, withExec, dialing := k.alice, k.withCert, k.withExec, k.dialing
	plain := alice(func(*rest.Config) {})
	for _, tc := range []struct {
		name string
		want isolationWant
		a, b isolationSide
	}{
		// Identity fields: never shared.
		{"CA bundle", differ, plain, alice(func(c *rest.Config) { c.CAData = append(f.ca.CertPEM(), otherCA.CertPEM()...) })},
		{"CA file vs the same CA inline", differ, plain, alice(func(c *rest.Config) { c.CAData, c.CAFile = nil, alicePaths.CA })},
		{"client certificate", differ, withCert(f.alice), withCert(f.bob)},
		{"certificate only (same key)", differ, withCert(f.alice), withCert(aliceReissued)},
		{"key only (same key, other encoding)", differ, withCert(f.alice), withCert(alicePKCS8)},
		{"certificate files vs the same bytes inline", differ, plain, alice(func(c *rest.Config) {
			c.CertData, c.KeyData, c.CertFile, c.KeyFile = nil, nil, alicePaths.Cert, alicePaths.Key
		})},
		{"exec plugin certificate", differ, withExec(execAlice, "exec-alice"), withExec(execBob, "exec-bob")},
		{"exec plugin vs inline certificate", differ, withExec(execAlice, "exec-alice"), plain},
		{"insecure", differ, plain, alice(func(c *rest.Config) { c.CAData, c.Insecure = nil, true })},
		{"server name", differ, plain, alice(func(c *rest.Config) { c.ServerName = "localhost" })},
		{"next protos", differ, plain, alice(func(c *rest.Config) { c.NextProtos = []string{"h2", "http/1.1"} })},
		{"disable compression", differ, plain, alice(func(c *rest.Config) { c.DisableCompression = true })},
		{"proxy URL", differ, alice(proxied(proxy1)), alice(proxied(proxy2))},
		{"proxy vs direct", differ, plain, alice(proxied(proxy1))},
		{"dial identity", differ, alice(dialing(relay1, "relay-1")), alice(dialing(relay2, "relay-2"))},

		// Per-request fields: always shared.
		{"bearer token", share, alice(func(c *rest.Config) { c.BearerToken = "token-a" }), alice(func(c *rest.Config) { c.BearerToken = "token-b" })},
		{"basic auth", share, alice(func(c *rest.Config) { c.Username, c.Password = "u1", "p1" }), alice(func(c *rest.Config) { c.Username, c.Password = "u2", "p2" })},
		{"impersonation", share, plain, alice(func(c *rest.Config) {
			c.Impersonate = rest.ImpersonationConfig{UserName: "someone", Groups: []string{"g"}}
		})},
		{"user agent", share, alice(func(c *rest.Config) { c.UserAgent = "agent-a" }), alice(func(c *rest.Config) { c.UserAgent = "agent-b" })},
		// Two names of one server: one transport; net/http pools
		// connections per host name, so one connection each.
		{"host", shareTransport, plain, alice(host("localhost"))},
		{"same proxy URL, other Proxy function", share, alice(proxied(proxy1)), alice(proxied(proxy1))},
		{"same exec plugin", share, withExec(execAlice, "exec-alice"), withExec(execAlice, "exec-alice")},
		// WithDialIdentity's promise: same name, interchangeable dialers;
		// the first config's dialer serves both.
		{"same dial identity, other dialer", share, alice(dialing(relay1, "relay")), alice(dialing(relay2, "relay"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resetMember(t, f)
			ledger.reset()
			p := newPool(t, WithDialIdentity(k.dialIdentity))
			loadBothSides(t, p, tc.a, tc.b)
			checkIsolation(t, tc.want, ledger, p)
		})
	}

	// The server's check is live: a config that claims another certificate
	// than the one it holds is caught.
	t.Run("the check catches a config that lies", func(t *testing.T) {
		ledger.reset()
		cfg := f.srv.RestConfig(f.alice)
		tag(cfg, "liar", "bob")
		must(t, listNodes(context.Background(), cfg))
		if _, _, mismatches, _ := ledger.snapshot(); len(mismatches) != 1 {
			t.Errorf("mismatches %q, want exactly one", mismatches)
		}
	})
}

// isolationSide is one config of a TestIsolation case and the client
// certificate it holds.
type isolationSide struct {
	cn  string // the client certificate the config holds
	cfg func() *rest.Config
}

// isolationWant is what a TestIsolation case expects of its two configs.
type isolationWant int

const (
	differ         isolationWant = iota
	share                        // one transport, one connection
	shareTransport               // one transport, a connection per host name
)

// isolationKit builds TestIsolation's sides on one fixture.
type isolationKit struct {
	f *fixture
	// dialNames names a config's dialer for WithDialIdentity.
	dialNames sync.Map // *rest.Config -> string
}

// dialIdentity is the pool's WithDialIdentity: the name dialing gave cfg.
func (k *isolationKit) dialIdentity(cfg *rest.Config) string {
	name, _ := k.dialNames.Load(cfg)
	s, _ := name.(string)
	return s
}

// alice is alice's config changed by mutate.
func (k *isolationKit) alice(mutate func(*rest.Config)) isolationSide {
	return isolationSide{"alice", func() *rest.Config {
		c := k.f.srv.RestConfig(k.f.alice)
		mutate(c)
		return c
	}}
}

func (k *isolationKit) withCert(kp *testserver.KeyPair) isolationSide {
	return isolationSide{kp.Cert.Subject.CommonName, func() *rest.Config { return k.f.srv.RestConfig(kp) }}
}

func (k *isolationKit) withExec(exec *clientcmdapi.ExecConfig, cn string) isolationSide {
	return isolationSide{cn, func() *rest.Config {
		c := k.f.srv.RestConfig(nil)
		cp := *exec
		c.ExecProvider = &cp
		return c
	}}
}

// dialing gives a config r's dialer, named name.
func (k *isolationKit) dialing(r *forwarder, name string) func(*rest.Config) {
	return func(c *rest.Config) {
		c.Dial = r.dial()
		k.dialNames.Store(c, name)
	}
}

// proxied sends a config through p, with a new Proxy closure per config.
func proxied(p *connectProxy) func(*rest.Config) {
	return func(c *rest.Config) {
		u, _ := url.Parse(p.url())
		c.Proxy = func(*http.Request) (*url.URL, error) { return u, nil }
	}
}

// host names the server h in a config's Host.
func host(h string) func(*rest.Config) {
	return func(c *rest.Config) { c.Host = strings.Replace(c.Host, "127.0.0.1", h, 1) }
}

// The requests loadBothSides sends per config: some in turn, then some at
// once.
const isolationSequential, isolationConcurrent = 4, 8

// loadBothSides wraps both sides' configs in p, tagged "A" and "B" with the
// certificate each holds, and lists nodes with each, in turn and then
// concurrently.
func loadBothSides(t *testing.T, p *Pool, a, b isolationSide) {
	t.Helper()
	var clients []*kubernetes.Clientset
	for i, s := range []isolationSide{a, b} {
		cfg := s.cfg()
		cfg.QPS, cfg.Burst = 1e6, 1e6 // client-go's rate limiter is not under test
		tag(cfg, string(rune('A'+i)), s.cn)
		cs, err := declaredClientset(p, cfg, WithPerRequestWrappers()) // the tag leaves connections alone
		must(t, err)
		clients = append(clients, cs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list := func(cs *kubernetes.Clientset) error {
		_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		return err
	}
	for range isolationSequential {
		for _, cs := range clients {
			must(t, list(cs))
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*isolationConcurrent)
	for range isolationConcurrent {
		for _, cs := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := list(cs); err != nil {
					errs <- err
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// checkIsolation checks what the server's ledger and the pool saw of
// loadBothSides against want.
func checkIsolation(t *testing.T, want isolationWant, ledger *connLedger, p *Pool) {
	t.Helper()
	conns, shared, mismatches, requests := ledger.snapshot()
	st := p.Stats()
	t.Logf("server: %d requests, connections per config %v, %d shared; pool: %d identities, %d misses, %d hits",
		requests, conns, shared, st.Identities, st.Misses, st.Hits)
	for _, m := range mismatches {
		t.Error(m)
	}
	if n := 2 * (isolationSequential + isolationConcurrent); requests != n {
		t.Errorf("server saw %d tagged requests, want %d", requests, n)
	}
	if st.PassThrough != 0 {
		t.Errorf("%d configs passed through: the case does not test the pool", st.PassThrough)
	}
	switch want {
	case differ:
		if st.Identities != 2 || st.Misses != 2 {
			t.Errorf("pool built %d transports for %d identities, want 2 and 2", st.Misses, st.Identities)
		}
		if shared != 0 {
			t.Errorf("%d connections carried requests of both configs", shared)
		}
	case share, shareTransport:
		if st.Identities != 1 || st.Misses != 1 || st.Hits != 1 {
			t.Errorf("pool: %d identities, %d misses, %d hits; want one shared transport", st.Identities, st.Misses, st.Hits)
		}
		if conns["A"] != 1 || conns["B"] != 1 {
			t.Errorf("connections per config %v, want one each", conns)
		}
		if want == share && shared != 1 {
			t.Errorf("the two configs used %d shared connections, want 1", shared)
		}
		if want == shareTransport && shared != 0 {
			t.Errorf("the two configs, of two host names, used %d shared connections, want none", shared)
		}
	}
}

// checkExecRotation: when an exec plugin's certificate changes, client-go
// closes the connections its authenticator dialed, so that the next
// handshake presents the new certificate. The pool's connections must be
// among them, also for a config with its own Dial (WithDialIdentity), and
// the next handshake must not resume a session of the old certificate.
func checkExecRotation(t *testing.T, opts ...Option) {
	var mu sync.Mutex
	var lastCN string
	f := newFixture(t, testserver.Options{OnRequest: func(ri testserver.RequestInfo) {
		mu.Lock()
		lastCN = ri.CertCN
		mu.Unlock()
	}})
	seen := func() string {
		mu.Lock()
		defer mu.Unlock()
		return lastCN
	}
	for _, customDial := range []bool{false, true} {
		t.Run(fmt.Sprintf("custom Dial %v", customDial), func(t *testing.T) {
			before, err := f.ca.IssueClient("exec-before")
			must(t, err)
			after, err := f.ca.IssueClient("exec-after")
			must(t, err)
			name := fmt.Sprintf("rotating-%v", customDial)
			exec := writeExecPlugin(t, f.dir, name, before)
			// The plugin's first credential expires soon: client-go runs
			// the plugin again on the first request after that.
			expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
			writeExecCredential(t, f.dir, name, before, expiry)

			p := newPool(t, append([]Option{WithDialIdentity(func(*rest.Config) string { return "plain" })}, opts...)...)
			cfg := f.srv.RestConfig(nil)
			cfg.ExecProvider = exec
			// A config with its own Dial: HTTPClientFor, as Wrap passes it
			// through.
			var cs kubernetes.Interface
			if customDial {
				cfg.Dial = (&net.Dialer{}).DialContext
				cs, err = pooledClientset(p, cfg)
			} else {
				cs, err = wrapped(cfg, wrapFn(p))
			}
			must(t, err)
			ctx := context.Background()
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Fatal(err)
			}
			if got := seen(); got != "exec-before" {
				t.Fatalf("server saw %q, want exec-before", got)
			}
			writeExecCredential(t, f.dir, name, after, time.Time{})
			time.Sleep(time.Until(expiry) + 100*time.Millisecond)
			for range 2 { // the first request runs the plugin again
				if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			st := p.Stats()
			if got := seen(); got != "exec-after" {
				t.Errorf("after the plugin's certificate changed the server saw %q, want exec-after (pool %+v)", got, st)
			}
			if st.PassThrough != 0 || st.Identities != 1 {
				t.Errorf("pool %+v: the config was not served by the pool", st)
			}
		})
	}
}

// TestExecCertRotation: the pool's connections close with the exec
// authenticator's, with client-go's dialer and with a config's own Dial.
// Session resumption is off here; see TestExecCertRotationResumption.
func TestExecCertRotation(t *testing.T) {
	checkExecRotation(t, WithSessionResumption(false))
}

// TestExecCertRotationResumption: with the default options (session
// resumption on), the connection after an exec plugin's certificate changed
// must authenticate with the new certificate, not resume a session of the
// old one.
func TestExecCertRotationResumption(t *testing.T) {
	checkExecRotation(t)
}
