package sharedtransport

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	spdystream "k8s.io/apimachinery/pkg/util/httpstream/spdy"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport/spdy"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestSeedLoad: the seed's load, 100 workers x 20 requests, each through a
// fresh config and clientset from one kubeconfig. With the pool every config
// rides one transport, with Proxy set (Karmada's member configs, through
// HTTPClientFor) or not (through Wrap); client-go alone with Proxy set, the
// control, dials once per request. TestSeedLoadBesideWatch compares the
// pool's connections with client-go's best case.
func TestSeedLoad(t *testing.T) {
	const workers, requests = 100, 20
	f := newFixture(t, testserver.Options{})
	kubeconfig := f.kubeconfig(t, "alice", f.alice).Kubeconfig

	for _, tc := range []struct {
		name      string
		withProxy bool
	}{{"proxy set, as Karmada's member configs", true}, {"no proxy", false}} {
		t.Run(tc.name, func(t *testing.T) {
			f.srv.CloseClientConnections()
			f.srv.ResetStats()
			p := newPool(t)
			seedLoad(t, workers, requests, func() (kubernetes.Interface, error) {
				cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
				if err != nil {
					return nil, err
				}
				if tc.withProxy {
					cfg.Proxy = nilProxy
					return pooledClientset(p, cfg)
				}
				return wrapped(cfg, wrapFn(p))
			})
			st := f.srv.Stats()
			t.Logf("with the pool: %d requests, server accepted %d connections, %d full handshakes; pool %+v",
				workers*requests, st.Accepted, st.FullHandshakes, p.Stats())
			if got := p.Stats(); got.Misses != 1 || got.Identities != 1 {
				t.Errorf("pool built %d transports for %d identities, want 1 and 1", got.Misses, got.Identities)
			}
		})
	}

	t.Run("without the pool, proxy set", func(t *testing.T) {
		f.srv.CloseClientConnections()
		f.srv.ResetStats()
		seedLoad(t, workers, requests, func() (kubernetes.Interface, error) {
			cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
			if err != nil {
				return nil, err
			}
			cfg.Proxy = nilProxy
			return kubernetes.NewForConfig(cfg)
		})
		st := f.srv.Stats()
		t.Logf("client-go alone: %d requests, server accepted %d connections", workers*requests, st.Accepted)
		if st.Accepted < workers*requests {
			t.Errorf("client-go alone: the server accepted %d connections, want one per request (%d): the load does not show the problem", st.Accepted, workers*requests)
		}
		f.srv.CloseClientConnections()
	})
}

// TestIdentities: different client certificates never share a connection;
// configs differing only in per-request credentials always do.
func TestIdentities(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{} // "cn/token" -> requests
	f := newFixture(t, testserver.Options{
		Tokens: map[string]string{"token-1": "t1", "token-2": "t2"},
		OnRequest: func(ri testserver.RequestInfo) {
			mu.Lock()
			seen[ri.CertCN+"/"+ri.Token]++
			mu.Unlock()
		},
	})
	p := newPool(t)
	ctx := context.Background()
	for _, kp := range []*testserver.KeyPair{f.alice, f.bob, f.carol} {
		for range 3 {
			cfg := f.srv.RestConfig(kp)
			must(t, p.Wrap(cfg))
			must(t, listNodes(ctx, cfg))
		}
	}
	if st := f.srv.Stats(); st.Accepted != 3 {
		t.Errorf("alice, bob, carol: server accepted %d connections, want 3", st.Accepted)
	}
	for _, cn := range []string{"alice", "bob", "carol"} {
		if seen[cn+"/"] != 3 {
			t.Errorf("server saw %d requests from %s, want 3 (all: %v)", seen[cn+"/"], cn, seen)
		}
	}

	// Only the token differs: one identity, one connection, each request
	// carrying its own token.
	f.srv.CloseClientConnections()
	f.srv.ResetStats()
	p2 := newPool(t)
	for _, token := range []string{"token-1", "token-2", "token-1"} {
		cfg := f.srv.RestConfig(f.alice)
		cfg.BearerToken = token
		cfg.UserAgent = "agent-" + token
		cfg.Impersonate = rest.ImpersonationConfig{}
		must(t, p2.Wrap(cfg))
		must(t, listNodes(ctx, cfg))
	}
	if st := f.srv.Stats(); st.Accepted != 1 {
		t.Errorf("configs differing only in token: %d connections, want 1", st.Accepted)
	}
	if seen["alice/token-1"] != 2 || seen["alice/token-2"] != 1 {
		t.Errorf("server saw tokens %v, want token-1 twice and token-2 once", seen)
	}
	if got := p2.Stats(); got.Identities != 1 || got.Hits != 2 || got.Misses != 1 {
		t.Errorf("stats %+v, want 1 identity, 1 miss, 2 hits", got)
	}
}

// TestCopySafety: a copy of a wrapped config whose credentials changed after
// Wrap authenticates with its own credentials.
func TestCopySafety(t *testing.T) {
	var mu sync.Mutex
	var last string
	f := newFixture(t, testserver.Options{OnRequest: func(ri testserver.RequestInfo) {
		mu.Lock()
		last = ri.CertCN
		mu.Unlock()
	}})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	p := newPool(t)
	orig := f.srv.RestConfig(f.alice)
	must(t, p.Wrap(orig))
	ctx := context.Background()

	for _, tc := range []struct {
		name    string
		mutate  func(*rest.Config)
		wantCN  string
		wantErr bool
	}{
		{"unchanged copy shares", func(*rest.Config) {}, "alice", false},
		{"client certificate data", func(c *rest.Config) { c.CertData, c.KeyData = f.bob.CertPEM, f.bob.KeyPEM }, "bob", false},
		{"client certificate files", func(c *rest.Config) {
			paths := f.kubeconfig(t, "carol", f.carol)
			c.CertData, c.KeyData, c.CertFile, c.KeyFile = nil, nil, paths.Cert, paths.Key
		}, "carol", false},
		// A copy that trusts another CA must not be vouched for by alice's
		// verified connection: the handshake with its own CA fails.
		{"CA", func(c *rest.Config) { c.CAData = otherCA.CertPEM() }, "", true},
		{"server name", func(c *rest.Config) { c.ServerName = "not-the-server.example" }, "", true},
		{"insecure", func(c *rest.Config) { c.CAData = nil; c.Insecure = true }, "alice", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := p.Stats().PassThrough
			cp := rest.CopyConfig(orig)
			tc.mutate(cp)
			mu.Lock()
			last = ""
			mu.Unlock()
			err := listNodes(ctx, cp)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error: %v", err, tc.wantErr)
			}
			mu.Lock()
			got := last
			mu.Unlock()
			if !tc.wantErr && got != tc.wantCN {
				t.Errorf("server saw %q, want %q", got, tc.wantCN)
			}
			passed := p.Stats().PassThrough - before
			if tc.name == "unchanged copy shares" && passed != 0 {
				t.Errorf("an unchanged copy passed through")
			}
			if tc.name != "unchanged copy shares" && passed != 1 {
				t.Errorf("a changed copy was not passed through (%d)", passed)
			}
		})
	}
}

type countingRT struct {
	mu    sync.Mutex
	n     int
	next  http.RoundTripper
	total *countingRT // also counted here, when set
}

func (c *countingRT) RoundTrip(r *http.Request) (*http.Response, error) {
	c.inc()
	if c.total != nil {
		c.total.inc()
	}
	return c.next.RoundTrip(r)
}

func (c *countingRT) inc() {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
}

func (c *countingRT) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

func TestHookComposition(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	cfg := f.srv.RestConfig(f.alice)
	beforeSeen, afterSeen := &countingRT{}, &countingRT{}
	var before, after *countingRT
	var innerOfAfter http.RoundTripper
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		before = &countingRT{next: rt, total: beforeSeen}
		return before
	}
	must(t, p.Wrap(cfg, WithPerRequestWrappers()))
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		innerOfAfter = rt
		after = &countingRT{next: rt, total: afterSeen}
		return after
	})
	for range 3 {
		must(t, listNodes(context.Background(), cfg))
	}
	// Wrap sends no request of its own through either.
	if beforeSeen.count() != 3 || afterSeen.count() != 3 {
		t.Errorf("wrappers saw %d and %d requests, want 3 and 3", beforeSeen.count(), afterSeen.count())
	}
	if _, ok := before.next.(*clientTransport); !ok {
		t.Errorf("the wrapper set before Wrap wraps %T, want the pool's round tripper innermost", before.next)
	}
	if innerOfAfter != before {
		t.Errorf("the wrapper added after Wrap does not wrap the earlier one")
	}

	t.Run("SPDY and other round trippers pass through", func(t *testing.T) {
		hook := f.srv.RestConfig(f.alice)
		must(t, p.Wrap(hook))
		tlsConfig, err := rest.TLSConfigFor(hook)
		must(t, err)
		spdyRT, err := spdystream.NewRoundTripper(tlsConfig)
		must(t, err)
		other := &countingRT{next: http.DefaultTransport}
		for _, rt := range []http.RoundTripper{spdyRT, other, http.DefaultTransport} {
			if got := hook.WrapTransport(rt); got != rt {
				t.Errorf("hook replaced %T with %T", rt, got)
			}
		}
		// The real path: spdy.RoundTripperFor runs the config's wrappers.
		wrapped, upgrader, err := spdy.RoundTripperFor(hook)
		must(t, err)
		if unwrapToTransport(wrapped) != nil || upgrader == nil {
			t.Errorf("the SPDY round tripper was replaced: %T", wrapped)
		}
	})

	t.Run("user Transport and plain configs pass through", func(t *testing.T) {
		before := p.Stats().PassThrough
		own := f.srv.RestConfig(nil)
		own.TLSClientConfig = rest.TLSClientConfig{}
		own.Transport = &countingRT{next: http.DefaultTransport}
		plain := &rest.Config{Host: "https://127.0.0.1:1", BearerToken: "x"}
		for _, c := range []*rest.Config{own, plain} {
			must(t, p.Wrap(c))
			if c.WrapTransport != nil {
				t.Errorf("a config the pool cannot share got a hook")
			}
		}
		if got := p.Stats().PassThrough - before; got != 2 {
			t.Errorf("PassThrough grew by %d, want 2", got)
		}
	})
}

// TestClients: every kind of client-go client works through the pool.
func TestClients(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	kubeconfig := f.kubeconfig(t, "alice", f.alice).Kubeconfig
	cfg, err := p.BuildConfigFromFlags("", kubeconfig)
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	if _, err := cs.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("typed clientset: %v", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	must(t, err)
	if _, err := dyn.Resource(schema.GroupVersionResource{Version: "v1", Resource: "nodes"}).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("dynamic client: %v", err)
	}
	disco, err := discovery.NewDiscoveryClientForConfig(cfg)
	must(t, err)
	if _, err := disco.ServerVersion(); err != nil {
		t.Errorf("discovery: %v", err)
	}
	httpClient, err := rest.HTTPClientFor(cfg)
	must(t, err)
	cs2, err := kubernetes.NewForConfigAndClient(cfg, httpClient)
	must(t, err)
	if _, err := cs2.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("NewForConfigAndClient: %v", err)
	}

	factory := informers.NewSharedInformerFactory(cs, 0)
	nodes := factory.Core().V1().Nodes().Informer()
	namespaces := factory.Core().V1().Namespaces().Informer()
	stop := make(chan struct{})
	factory.Start(stop)
	synced := cache.WaitForCacheSync(ctx.Done(), nodes.HasSynced, namespaces.HasSynced)
	if !synced {
		t.Error("informers did not sync")
	}
	if len(nodes.GetStore().List()) == 0 {
		t.Error("node informer is empty")
	}
	if n, ok := nodes.GetStore().List()[0].(*corev1.Node); !ok || n.Name == "" {
		t.Errorf("node informer holds %T", nodes.GetStore().List()[0])
	}
	close(stop)
	factory.Shutdown()

	if st := f.srv.Stats(); st.Accepted != 1 {
		t.Errorf("every client together opened %d connections, want 1", st.Accepted)
	}
	if st := p.Stats(); st.Identities != 1 || st.PassThrough != 0 {
		t.Errorf("pool stats %+v, want one identity and nothing passed through", st)
	}
}

// TestLifetime: identities nobody refers to are released; Close closes
// everything and later use fails clearly.
func TestLifetime(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(0))
	ctx := context.Background()
	const n = 1000
	live := make([]*rest.Config, 0, n)
	for i := range n {
		// Distinct server names make distinct identities over one server.
		cfg := f.srv.RestConfig(nil)
		cfg.ServerName = fmt.Sprintf("n%d.example", i)
		must(t, p.Wrap(cfg))
		live = append(live, cfg)
	}
	runtime.GC()
	if got := p.Stats().Identities; got != n {
		t.Fatalf("%d identities while %d distinct wrapped configs are live", got, n)
	}
	runtime.KeepAlive(live)
	live = nil
	waitFor(t, "identities released after GC", func() bool {
		runtime.GC()
		return p.Stats().Identities == 0
	})

	// A live config keeps its identity when another config of the same
	// identity is collected: its connection stays open and its requests
	// keep going over it. A dropped config of another identity (bob) shows
	// when the dropped leases have been released.
	f.srv.ResetStats()
	p2 := newPool(t, WithIdleTimeout(0))
	kept := f.srv.RestConfig(f.carol)
	must(t, p2.Wrap(kept))
	must(t, listNodes(ctx, kept))
	for _, kp := range []*testserver.KeyPair{f.carol, f.bob} {
		must(t, p2.Wrap(f.srv.RestConfig(kp)))
	}
	waitFor(t, "the dropped configs' identity released after GC", func() bool {
		runtime.GC()
		return p2.Stats().Identities <= 1
	})
	for range 3 {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if err := listNodes(ctx, kept); err != nil {
		t.Fatalf("a live config's request after another config of its identity was collected: %v", err)
	}
	if st := f.srv.Stats(); st.Accepted != 1 || st.Open != 1 {
		t.Errorf("a live config, another of its identity collected: server accepted %d connections, %d open; want the first one, still open", st.Accepted, st.Open)
	}
	runtime.KeepAlive(kept)
	must(t, p2.Close())

	// A live config keeps its identity; Close ends it.
	cfg := f.srv.RestConfig(f.alice)
	must(t, p.Wrap(cfg))
	must(t, listNodes(ctx, cfg))
	runtime.GC()
	if got := p.Stats().Identities; got != 1 {
		t.Errorf("a referenced identity was released: %d identities", got)
	}
	built, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	must(t, p.Close())
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := built.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); !errors.Is(err, ErrClosed) {
		t.Errorf("request through a client built before Close: %v, want ErrClosed", err)
	}
	if err := listNodes(ctx, cfg); !errors.Is(err, ErrClosed) {
		t.Errorf("request through a client built after Close: %v, want ErrClosed", err)
	}
	if err := p.Wrap(f.srv.RestConfig(f.bob)); !errors.Is(err, ErrClosed) {
		t.Errorf("Wrap on a closed pool: %v, want ErrClosed", err)
	}
	waitFor(t, "server sees every connection closed", func() bool { return f.srv.Stats().Open == 0 })
	if st := p.Stats(); st.OpenConns != 0 {
		t.Errorf("pool counts %d open connections after Close", st.OpenConns)
	}
}

// TestCloseRaced: a Close called while another is still closing the pool
// returns only once the pool is closed, with the same result, so whichever
// caller returns first may rely on every connection being closed.
func TestCloseRaced(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithDialIdentity(func(*rest.Config) string { return "held on close" }))
	closing, release := make(chan struct{}), make(chan struct{})
	var signal sync.Once
	cfg := f.srv.RestConfig(f.alice)
	cfg.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		return &heldOnClose{Conn: c, closing: func() { signal.Do(func() { close(closing) }) }, release: release}, nil
	}
	cs, err := pooledClientset(p, cfg)
	must(t, err)
	listNodesOf(t, cs)

	first := make(chan error, 1)
	go func() { first <- p.Close() }()
	<-closing // the first Close is closing the identity's connection
	second := make(chan error, 1)
	go func() { second <- p.Close() }()
	select {
	case err := <-second:
		t.Errorf("a second Close returned (%v) while the first was still closing the pool's connections", err)
		second <- err
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	for _, c := range []chan error{first, second} {
		if err := <-c; err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	if st := p.Stats(); st.OpenConns != 0 {
		t.Errorf("the pool counts %d open connections once both Closes returned", st.OpenConns)
	}
	runtime.KeepAlive(cs)
}

// heldOnClose is a connection whose Close waits until release is closed.
type heldOnClose struct {
	net.Conn
	closing func()
	release chan struct{}
}

func (c *heldOnClose) Close() error {
	c.closing()
	<-c.release
	return c.Conn.Close()
}

// TestPoolString: a pool prints as one line of counts, under %v, %+v and
// %#v alike, never its fields (key material, and state that changes under
// the pool's locks while it is printed).
func TestPoolString(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	cfg := f.srv.RestConfig(f.alice)
	must(t, p.Wrap(cfg))
	must(t, listNodes(context.Background(), cfg))
	want := "sharedtransport.Pool{identities: 1, open connections: 1, dials: 1, hits: 0, misses: 1, passed through: 0}"
	for _, verb := range []string{"%v", "%+v", "%#v", "%s"} {
		if got := fmt.Sprintf(verb, p); got != want {
			t.Errorf("%s: %s, want %s", verb, got, want)
		}
	}
	p.Close()
	if got := p.String(); !strings.HasSuffix(got, ", closed}") {
		t.Errorf("closed: %s", got)
	}
}

// TestWrapClientConfig: every config a clientcmd.ClientConfig that
// WrapClientConfig wrapped returns is wrapped (one identity, taken once per
// config) and its clients reach the server over one connection, as through
// client-go alone (the control); the rest of the interface (namespace, raw
// config) is the inner ClientConfig's.
func TestWrapClientConfig(t *testing.T) {
	const configs = 5
	for _, pool := range []bool{false, true} {
		t.Run(fmt.Sprintf("pool=%v", pool), func(t *testing.T) {
			f := newFixture(t, testserver.Options{})
			paths, err := f.srv.WriteKubeconfig(filepath.Join(t.TempDir(), "kubeconfig"), f.alice, false)
			must(t, err)
			inner := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
				&clientcmd.ClientConfigLoadingRules{ExplicitPath: paths.Kubeconfig}, &clientcmd.ConfigOverrides{})
			cc := inner
			p := newPool(t)
			if pool {
				cc = p.WrapClientConfig(inner)
			}
			for range configs {
				cfg, err := cc.ClientConfig()
				must(t, err)
				if wrapped := cfg.WrapTransport != nil; wrapped != pool {
					t.Fatalf("config wrapped: %v, want %v", wrapped, pool)
				}
				cs, err := kubernetes.NewForConfig(cfg)
				must(t, err)
				if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			ns, _, err := cc.Namespace()
			wantNS, _, _ := inner.Namespace()
			if err != nil || ns != wantNS {
				t.Errorf("Namespace() = %q, %v; the inner ClientConfig's is %q", ns, err, wantNS)
			}
			if raw, err := cc.RawConfig(); err != nil || raw.CurrentContext == "" {
				t.Errorf("RawConfig(): current context %q, %v", raw.CurrentContext, err)
			}
			st, ps := f.srv.Stats(), p.Stats()
			t.Logf("%d configs: server accepted %d connections; pool %+v", configs, st.Accepted, ps)
			if st.Accepted != 1 {
				t.Errorf("%d configs: server accepted %d connections, want 1", configs, st.Accepted)
			}
			if pool && (ps.Misses != 1 || ps.Hits != configs-1 || ps.PassThrough != 0) {
				t.Errorf("pool: %d misses, %d hits, %d passed through; want 1, %d, 0", ps.Misses, ps.Hits, ps.PassThrough, configs-1)
			}
		})
	}
}

// unwrapToTransport returns the *http.Transport under rt's wrappers, as
// client-go's helpers find it (utilnet.RoundTripperWrapper), or nil.
func unwrapToTransport(rt http.RoundTripper) *http.Transport {
	for range 8 {
		switch t := rt.(type) {
		case *http.Transport:
			return t
		case utilnet.RoundTripperWrapper:
			rt = t.WrappedRoundTripper()
		default:
			return nil
		}
	}
	return nil
}
