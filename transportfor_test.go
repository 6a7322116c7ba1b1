package sharedtransport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// requestLog keeps what the server saw, by the request's "case" query
// parameter.
type requestLog struct {
	mu   sync.Mutex
	seen map[string]testserver.RequestInfo
}

func newRequestLog() *requestLog { return &requestLog{seen: map[string]testserver.RequestInfo{}} }

func (l *requestLog) record(ri testserver.RequestInfo) {
	q, err := url.ParseQuery(ri.Query)
	if err != nil || q.Get("case") == "" {
		return
	}
	l.mu.Lock()
	l.seen[q.Get("case")] = ri
	l.mu.Unlock()
}

func (l *requestLog) get(t testing.TB, name string) testserver.RequestInfo {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	ri, ok := l.seen[name]
	if !ok {
		t.Fatalf("the server saw no request %q", name)
	}
	return ri
}

// getVia sends GET url through rt and returns the response's status.
func getVia(rt http.RoundTripper, url string) (int, error) {
	resp, err := (&http.Client{Transport: rt, Timeout: 30 * time.Second}).Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

// headerRoundTripper sets a header on every request, as a user's
// WrapTransport might.
type headerRoundTripper struct {
	next        http.RoundTripper
	name, value string
}

func (h *headerRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set(h.name, h.value)
	return h.next.RoundTrip(req)
}

func (h *headerRoundTripper) WrappedRoundTripper() http.RoundTripper { return h.next }

func setHeader(name, value string) func(http.RoundTripper) http.RoundTripper {
	return func(rt http.RoundTripper) http.RoundTripper { return &headerRoundTripper{rt, name, value} }
}

// TestTransportForLayers: every per-request layer client-go adds reaches the
// server through the pool's TransportFor exactly as through rest.TransportFor
// (client-go alone), with the identity's certificate, and every config of
// the identity rides one connection.
func TestTransportForLayers(t *testing.T) {
	must(t, registerAuthProvider())
	log := newRequestLog()
	f := newFixture(t, testserver.Options{RecordHeaders: true, OnRequest: log.record})
	tokenFile := filepath.Join(f.dir, "token")
	must(t, os.WriteFile(tokenFile, []byte("token-from-file\n"), 0o600))
	p := newPool(t)
	other := newPool(t)

	type want struct {
		of    func(testserver.RequestInfo) string
		value string
	}
	for _, tc := range []struct {
		name   string
		mutate func(*rest.Config)
		before func(*rest.Config) error // on the pool's config only, not the control's
		want   []want
	}{
		{name: "no layers"},
		{name: "bearer token", mutate: func(c *rest.Config) { c.BearerToken = "token-1" }, want: []want{{riToken, "token-1"}}},
		{name: "token file", mutate: func(c *rest.Config) { c.BearerTokenFile = tokenFile }, want: []want{{riToken, "token-from-file"}}},
		{name: "basic auth", mutate: func(c *rest.Config) { c.Username, c.Password = "jane", "secret" }, want: []want{{riBasicAuth, "jane:secret"}}},
		{name: "impersonation", mutate: func(c *rest.Config) {
			c.Impersonate = rest.ImpersonationConfig{UserName: "bob", UID: "42", Groups: []string{"g1", "g2"}, Extra: map[string][]string{"scopes": {"a", "b"}}}
		}, want: []want{
			{riHeader("Impersonate-User"), "bob"}, {riHeader("Impersonate-Uid"), "42"},
			{riHeader("Impersonate-Group"), "g1,g2"}, {riHeader("Impersonate-Extra-Scopes"), "a,b"},
		}},
		{name: "user agent", mutate: func(c *rest.Config) { c.UserAgent = "karmada-aggregated-apiserver/v1" },
			want: []want{{riHeader("User-Agent"), "karmada-aggregated-apiserver/v1"}}},
		{name: "WrapTransport", mutate: func(c *rest.Config) { c.Wrap(setHeader("X-Wrapped", "yes")) },
			want: []want{{riHeader("X-Wrapped"), "yes"}}},
		{name: "auth provider", mutate: func(c *rest.Config) {
			c.AuthProvider = &clientcmdapi.AuthProviderConfig{Name: testAuthProvider, Config: map[string]string{"token": "token-ap"}}
		}, want: []want{{riToken, "token-ap"}}},
		{name: "Proxy set (direct)", mutate: func(c *rest.Config) { c.Proxy, c.BearerToken = nilProxy, "token-2" }, want: []want{{riToken, "token-2"}}},
		{name: "all at once", mutate: func(c *rest.Config) {
			c.BearerToken, c.UserAgent = "token-3", "ua/3"
			c.Impersonate = rest.ImpersonationConfig{UserName: "carol"}
			c.Wrap(setHeader("X-Wrapped", "all"))
		}, want: []want{{riToken, "token-3"}, {riHeader("User-Agent"), "ua/3"}, {riHeader("Impersonate-User"), "carol"}, {riHeader("X-Wrapped"), "all"}}},
		{name: "wrapped by this pool before", mutate: func(c *rest.Config) { c.BearerToken = "token-4" },
			before: wrapFn(p), want: []want{{riToken, "token-4"}}},
		{name: "wrapped by another pool before", mutate: func(c *rest.Config) { c.UserAgent = "ua/5" },
			before: wrapFn(other), want: []want{{riHeader("User-Agent"), "ua/5"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.srv.RestConfig(f.alice)
			if tc.mutate != nil {
				tc.mutate(cfg)
			}
			control := rest.CopyConfig(cfg)
			if tc.before != nil {
				must(t, tc.before(cfg))
			}
			got, ctl := sendBoth(t, log, p, cfg, control, f.srv.URL(), tc.name)
			if got.CertCN != "alice" || ctl.CertCN != "alice" {
				t.Errorf("certificate: pool %q, client-go %q, want alice", got.CertCN, ctl.CertCN)
			}
			if !reflect.DeepEqual(got.Header, ctl.Header) {
				t.Errorf("headers differ\npool:      %v\nclient-go: %v", got.Header, ctl.Header)
			}
			for _, w := range tc.want {
				if v := w.of(got); v != w.value {
					t.Errorf("the server saw %q, want %q", v, w.value)
				}
			}
		})
	}
	conns := poolConns(log)
	if len(conns) != 1 {
		t.Errorf("the pool's requests came on %d connections, want 1", len(conns))
	}
	if st := p.Stats(); st.Misses != 1 || st.PassThrough != 0 || st.Identities != 1 {
		t.Errorf("pool %+v, want one identity, built once, nothing passed through", st)
	}
	if st := other.Stats(); st.PassThrough != 0 || st.Dials != 0 {
		t.Errorf("the other pool's hook took part: %+v", st)
	}
}

// riHeader reads the values of header name a request arrived with.
func riHeader(name string) func(testserver.RequestInfo) string {
	return func(ri testserver.RequestInfo) string { return strings.Join(ri.Header.Values(name), ",") }
}

// riBasicAuth reads the user:password of a request's basic auth.
func riBasicAuth(ri testserver.RequestInfo) string {
	u, pw, ok := (&http.Request{Header: ri.Header}).BasicAuth()
	if !ok {
		return ""
	}
	return u + ":" + pw
}

func riToken(ri testserver.RequestInfo) string { return ri.Token }

// poolConns are the connections the requests log saw the pool's requests
// (named ".../pool" by sendBoth) arrive on.
func poolConns(log *requestLog) map[string]bool {
	conns := map[string]bool{}
	log.mu.Lock()
	defer log.mu.Unlock()
	for name, ri := range log.seen {
		if strings.HasSuffix(name, "/pool") {
			conns[ri.RemoteAddr] = true
		}
	}
	return conns
}

// TestTransportForExecPlugin: an exec plugin's certificate is presented on
// the shared connections; with a token client-go's exec authenticator steps
// aside, and no certificate is presented, as with client-go alone.
func TestTransportForExecPlugin(t *testing.T) {
	log := newRequestLog()
	f := newFixture(t, testserver.Options{
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{"token-x": "token-user"},
		OnRequest:  log.record,
	})
	kp, err := f.ca.IssueClient("exec-user")
	must(t, err)
	exec := writeExecPlugin(t, f.dir, "transportfor", kp)
	p := newPool(t)
	for _, tc := range []struct {
		name          string
		token, wantCN string
	}{
		{"exec plugin", "", "exec-user"},
		{"exec plugin, second config", "", "exec-user"},
		{"exec plugin and a token", "token-x", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.srv.RestConfig(nil)
			cfg.ExecProvider = exec
			cfg.BearerToken = tc.token
			got, ctl := sendBoth(t, log, p, cfg, rest.CopyConfig(cfg), f.srv.URL(), tc.name)
			if got.CertCN != tc.wantCN || ctl.CertCN != tc.wantCN {
				t.Errorf("certificate: pool %q, client-go %q, want %q", got.CertCN, ctl.CertCN, tc.wantCN)
			}
			if got.Token != tc.token || ctl.Token != tc.token {
				t.Errorf("token: pool %q, client-go %q, want %q", got.Token, ctl.Token, tc.token)
			}
		})
	}
	a, b := log.get(t, "exec plugin/pool"), log.get(t, "exec plugin, second config/pool")
	if a.RemoteAddr != b.RemoteAddr {
		t.Errorf("two configs of one exec identity came on two connections (%s, %s)", a.RemoteAddr, b.RemoteAddr)
	}
	if st := p.Stats(); st.Identities != 2 || st.PassThrough != 0 {
		t.Errorf("pool %+v, want 2 identities (the plugin's certificate, none) and nothing passed through", st)
	}
}

// TestTransportForPassThrough: a config the pool cannot share gets what
// rest.TransportFor gives.
func TestTransportForPassThrough(t *testing.T) {
	log := newRequestLog()
	f := newFixture(t, testserver.Options{OnRequest: log.record})
	t.Run("own Transport", func(t *testing.T) { passThroughOwnTransport(t, f, log) })
	t.Run("custom Dial without a name", func(t *testing.T) { passThroughOwnDial(t, f) })
	t.Run("failing Proxy", func(t *testing.T) { passThroughFailingProxy(t, f) })
	t.Run("no TLS", func(t *testing.T) { passThroughNoTLS(t) })
}

// passThroughOwnTransport is TestTransportForPassThrough's "own Transport"
// case.
func passThroughOwnTransport(t *testing.T, f *fixture, log *requestLog) {
	p := newPool(t)
	tlsConfig, err := rest.TLSConfigFor(f.srv.RestConfig(f.alice))
	must(t, err)
	own := &countingRT{next: &http.Transport{TLSClientConfig: tlsConfig}}
	defer own.next.(*http.Transport).CloseIdleConnections()
	cfg := &rest.Config{Host: f.srv.URL(), Transport: own, BearerToken: "token-own"}
	rt, err := p.TransportFor(cfg)
	must(t, err)
	if code, err := getVia(rt, f.srv.URL()+"/version?case=own"); err != nil || code != http.StatusOK {
		t.Fatalf("%d %v", code, err)
	}
	if own.count() != 1 || log.get(t, "own").Token != "token-own" {
		t.Errorf("own transport saw %d requests, server saw token %q", own.count(), log.get(t, "own").Token)
	}
	if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
		t.Errorf("pool %+v, want one pass-through", st)
	}
}

// passThroughOwnDial is TestTransportForPassThrough's "custom Dial without a
// name" case.
func passThroughOwnDial(t *testing.T, f *fixture) {
	p := newPool(t)
	var dials atomic.Int64
	cfg := f.srv.RestConfig(f.alice)
	cfg.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
		dials.Add(1)
		var d net.Dialer
		return d.DialContext(ctx, network, address)
	}
	hc, err := p.HTTPClientFor(cfg)
	must(t, err)
	cs, err := kubernetes.NewForConfigAndClient(cfg, hc)
	must(t, err)
	if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if dials.Load() != 1 {
		t.Errorf("the config's own Dial dialed %d times, want 1", dials.Load())
	}
	if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 || st.Dials != 0 {
		t.Errorf("pool %+v, want one pass-through and no dial of its own", st)
	}
	utilnet.CloseIdleConnectionsFor(hc.Transport)
}

// passThroughFailingProxy is TestTransportForPassThrough's "failing Proxy"
// case.
func passThroughFailingProxy(t *testing.T, f *fixture) {
	p := newPool(t)
	proxyErr := errors.New("no route for this cluster")
	cfg := f.srv.RestConfig(f.alice)
	cfg.Proxy = func(*http.Request) (*url.URL, error) { return nil, proxyErr }
	rt, err := p.TransportFor(cfg)
	must(t, err)
	controlRT, err := rest.TransportFor(rest.CopyConfig(cfg))
	must(t, err)
	_, err = getVia(rt, f.srv.URL()+"/version")
	_, controlErr := getVia(controlRT, f.srv.URL()+"/version")
	if !errors.Is(err, proxyErr) || controlErr == nil || err.Error() != controlErr.Error() {
		t.Errorf("pool: %v; client-go: %v; want the Proxy's error from both", err, controlErr)
	}
	if st := p.Stats(); st.PassThrough != 1 || st.Identities != 0 {
		t.Errorf("pool %+v, want one pass-through", st)
	}
}

// passThroughNoTLS is TestTransportForPassThrough's "no TLS" case.
func passThroughNoTLS(t *testing.T) {
	p := newPool(t)
	cfg := &rest.Config{Host: "http://127.0.0.1:1"}
	rt, err := p.TransportFor(cfg)
	must(t, err)
	hc, err := p.HTTPClientFor(cfg)
	must(t, err)
	controlHC, err := rest.HTTPClientFor(cfg)
	must(t, err)
	if rt != http.DefaultTransport || hc != controlHC {
		t.Errorf("got %T and %p, want http.DefaultTransport and http.DefaultClient as from client-go", rt, hc)
	}
}

// TestTransportForProxyOtherHosts: with Proxy set, only requests to the
// config's host ride the shared transport; a request to another host goes
// where client-go sends it, also when the config's route equals the
// environment's (direct here).
func TestTransportForProxyOtherHosts(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	second := f.startServer(t, testserver.Options{})
	proxy := newConnectProxy(t)
	proxyURL, _ := url.Parse(proxy.url())
	// via reports whether the last request to srv came through the proxy.
	via := func(t *testing.T, srv *testserver.Server) string {
		ri, ok := srv.LastRequest("/version")
		if !ok {
			t.Fatal("no request seen")
		}
		if _, ok := proxy.Carried(ri.RemoteAddr, srv.Addr()); ok {
			return "proxy"
		}
		return "direct"
	}
	for _, tc := range []struct {
		name                  string
		proxiedHost           string // the host the Proxy sends through the proxy; others go direct
		wantConfig, wantOther string
	}{
		{"config's host through the proxy, others direct", f.srv.Addr(), "proxy", "direct"},
		{"config's host direct, others through the proxy", second.Addr(), "direct", "proxy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t)
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = func(req *http.Request) (*url.URL, error) {
				if req.URL.Host == tc.proxiedHost {
					return proxyURL, nil
				}
				return nil, nil
			}
			for name, newRT := range map[string]func(*rest.Config) (http.RoundTripper, error){"pool": transportForFn(p), "client-go": rest.TransportFor} {
				rt, err := newRT(rest.CopyConfig(cfg))
				must(t, err)
				for _, target := range []struct {
					srv  *testserver.Server
					want string
				}{{f.srv, tc.wantConfig}, {second, tc.wantOther}, {f.srv, tc.wantConfig}, {second, tc.wantOther}} {
					if code, err := getVia(rt, target.srv.URL()+"/version"); err != nil || code != http.StatusOK {
						t.Fatalf("%s to %s: %d %v", name, target.srv.Addr(), code, err)
					}
					if got := via(t, target.srv); got != target.want {
						t.Errorf("%s: a request to %s went %s, want %s", name, target.srv.Addr(), got, target.want)
					}
				}
				utilnet.CloseIdleConnectionsFor(rt)
			}
			if st := p.Stats(); st.Identities != 1 || st.PassThrough != 0 {
				t.Errorf("pool %+v", st)
			}
		})
	}
}

// TestTransportForConnectHeader: a Karmada-shaped wrapper setting CONNECT
// headers on the transport below it: the header is on the shared tunnel, and
// on client-go's tunnel for requests to another host.
func TestTransportForConnectHeader(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	second := f.startServer(t, testserver.Options{})
	proxy := newAuthProxy(t, "Basic a")
	p := newPool(t)
	const configs = 20
	var first http.RoundTripper
	defer func() { utilnet.CloseIdleConnectionsFor(first) }()
	for i := range configs {
		cfg := f.srv.RestConfig(nil)
		cfg.BearerToken = fmt.Sprintf("token-%d", i)
		cfg.Proxy = proxyTo(proxy)
		header := http.Header{"Proxy-Authorization": {"Basic a"}}
		cfg.WrapTransport = memberproxy.ProxyHeaderWrapper(cfg.WrapTransport, header)
		cfg.CertData, cfg.KeyData = f.alice.CertPEM, f.alice.KeyPEM
		rt, err := p.TransportFor(cfg, WithProxyConnectHeader(header))
		must(t, err)
		if code, err := getVia(rt, f.srv.URL()+"/version"); err != nil || code != http.StatusOK {
			t.Fatalf("config %d: %d %v", i, code, err)
		}
		if i == 0 {
			if code, err := getVia(rt, second.URL()+"/version"); err != nil || code != http.StatusOK {
				t.Fatalf("to the other host: %d %v", code, err)
			}
			first = rt
		}
	}
	if n, rej := proxy.Stats().Tunnels, proxy.Stats().Rejected; n != 2 || rej != 0 {
		t.Errorf("the proxy opened %d tunnels and refused %d, want 2 (one shared, one to the other host) and 0", n, rej)
	}
	if st := f.srv.Stats(); st.Accepted != 1 {
		t.Errorf("%d configs: the server accepted %d connections, want 1", configs, st.Accepted)
	}
}

// TestTransportForClients: HTTPClientFor's client under the typed, dynamic
// and discovery clients and an informer, one connection for all.
func TestTransportForClients(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	newConfig := func() *rest.Config {
		cfg := f.srv.RestConfig(f.alice)
		cfg.Proxy = nilProxy
		cfg.UserAgent = "transportfor-test"
		return cfg
	}
	client := func(cfg *rest.Config) *http.Client {
		hc, err := p.HTTPClientFor(cfg)
		must(t, err)
		return hc
	}

	cfg := newConfig()
	cs, err := kubernetes.NewForConfigAndClient(cfg, client(cfg))
	must(t, err)
	if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("typed clientset: %v", err)
	}
	cfg = newConfig()
	dyn, err := dynamic.NewForConfigAndClient(cfg, client(cfg))
	must(t, err)
	if _, err := dyn.Resource(schema.GroupVersionResource{Version: "v1", Resource: "nodes"}).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("dynamic client: %v", err)
	}
	cfg = newConfig()
	disco, err := discovery.NewDiscoveryClientForConfigAndClient(cfg, client(cfg))
	must(t, err)
	if _, err := disco.ServerGroups(); err != nil {
		t.Errorf("discovery: %v", err)
	}
	if _, err := disco.ServerVersion(); err != nil {
		t.Errorf("discovery: %v", err)
	}

	cfg = newConfig()
	informerClients, err := kubernetes.NewForConfigAndClient(cfg, client(cfg))
	must(t, err)
	factory := informers.NewSharedInformerFactory(informerClients, 0)
	nodes := factory.Core().V1().Nodes().Informer()
	stop := make(chan struct{})
	factory.Start(stop)
	if !cache.WaitForCacheSync(ctx.Done(), nodes.HasSynced) || len(nodes.GetStore().List()) == 0 {
		t.Error("node informer did not sync")
	}
	close(stop)
	factory.Shutdown()

	for _, ri := range f.srv.Requests() {
		if ri.CertCN != "alice" || ri.UserAgent != "transportfor-test" {
			t.Errorf("%s %s: certificate %q, user agent %q", ri.Method, ri.Path, ri.CertCN, ri.UserAgent)
		}
	}
	if st := f.srv.Stats(); st.Accepted != 1 {
		t.Errorf("every client together opened %d connections, want 1", st.Accepted)
	}
	if st := p.Stats(); st.Identities != 1 || st.PassThrough != 0 || st.Misses != 1 || st.Hits != 3 {
		t.Errorf("pool stats %+v, want one identity built once and 3 hits", st)
	}
}

// TestTransportForConnections: the seed's load with a config per request
// (a token, user agent and impersonation of its own, Proxy set), through
// HTTPClientFor: once a first request opened it, one connection, as
// client-go's best case, one transport for every config; with keep-alive
// off, one per request, the handshakes resumed.
func TestTransportForConnections(t *testing.T) {
	workers, requests := 50, 10
	if raceDetector() {
		requests = 4
	}
	f := newFixture(t, testserver.Options{})
	load := func(t *testing.T, httpClientFor func(*rest.Config) (*http.Client, error), workers, requests int) {
		errs := runClients(workers, requests, func(w, i int) error {
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = nilProxy
			cfg.BearerToken = fmt.Sprintf("token-%d-%d", w, i)
			cfg.UserAgent = fmt.Sprintf("worker-%d", w)
			cfg.Impersonate.UserName = fmt.Sprintf("user-%d", i)
			hc, err := httpClientFor(cfg)
			if err != nil {
				return err
			}
			cs, err := kubernetes.NewForConfigAndClient(cfg, hc)
			if err != nil {
				return err
			}
			_, err = cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
			return err
		})
		checkNoErrors(t, errs)
	}

	t.Run("keep-alive on", func(t *testing.T) {
		// After a first request opens the connection, every config's
		// requests ride it, as they ride client-go's best case's.
		accepted := map[string]uint64{}
		for _, mode := range []string{"client-go's best case", "pool"} {
			resetMember(t, f)
			var httpClientFor func(*rest.Config) (*http.Client, error)
			if mode == "pool" {
				p := newPool(t)
				httpClientFor = func(cfg *rest.Config) (*http.Client, error) { return p.HTTPClientFor(cfg) }
				defer func() {
					if st := p.Stats(); st.Misses != 1 || st.Hits != uint64(workers*requests) || st.PassThrough != 0 {
						t.Errorf("pool %+v, want 1 miss and %d hits", st, workers*requests)
					}
				}()
			} else {
				// One HTTP client for every config, the per-request
				// credentials set on each request as client-go sets them.
				shared := f.srv.RestConfig(f.alice)
				shared.Proxy = nilProxy
				rt, err := rest.TransportFor(shared)
				must(t, err)
				defer utilnet.CloseIdleConnectionsFor(rt)
				httpClientFor = func(cfg *rest.Config) (*http.Client, error) {
					wrapped, err := rest.HTTPWrappersForConfig(cfg, rt)
					return &http.Client{Transport: wrapped}, err
				}
			}
			load(t, httpClientFor, 1, 1)
			load(t, httpClientFor, workers, requests)
			accepted[mode] = f.srv.Stats().Accepted
			t.Logf("%s: %d configs of one identity after a first: the server accepted %d connections", mode, workers*requests, accepted[mode])
		}
		if accepted["pool"] > max(accepted["client-go's best case"], 1) {
			t.Errorf("%d configs of one identity: the pool's requests came on %d connections, client-go's best case's on %d", workers*requests, accepted["pool"], accepted["client-go's best case"])
		}
	})

	t.Run("keep-alive off", func(t *testing.T) {
		resetMember(t, f)
		p := newPool(t, WithKeepAlive(false))
		const n = 20
		load(t, func(cfg *rest.Config) (*http.Client, error) { return p.HTTPClientFor(cfg) }, 1, n)
		st := f.srv.Stats()
		if st.Accepted != n || st.FullHandshakes+st.ResumedHandshakes != n || st.ResumedHandshakes < n-2 {
			t.Errorf("keep-alive off, %d requests: %d connections, %d full and %d resumed handshakes; want %d connections, nearly all resumed",
				n, st.Accepted, st.FullHandshakes, st.ResumedHandshakes, n)
		}
		if st.Open > 1 {
			t.Errorf("keep-alive off left %d connections open", st.Open)
		}
	})
}

// TestTransportForLifetime: the round tripper keeps its identity; once it is
// gone the identity is released; rotation reaches it; Close ends it.
func TestTransportForLifetime(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := newPool(t, WithIdleTimeout(0), WithPollInterval(0), WithDrainTimeout(time.Second))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())

	rt, err := p.TransportFor(d.config(f.srv.URL()))
	must(t, err)
	if code, err := getVia(rt, f.srv.URL()+"/version"); err != nil || code != http.StatusOK {
		t.Fatalf("%d %v", code, err)
	}
	for range 3 {
		runtime.GC()
	}
	time.Sleep(50 * time.Millisecond)
	if got := p.Stats().Identities; got != 1 {
		t.Fatalf("%d identities while the round tripper is live, want 1", got)
	}

	d.write(t, f.bob, f.ca.CertPEM())
	written := time.Now()
	waitFor(t, "a request with the rotated certificate", func() bool {
		if _, err := getVia(rt, f.srv.URL()+"/version"); err != nil {
			t.Fatal(err)
		}
		_, ok := rec.firstSince("bob", written)
		return ok
	})

	runtime.KeepAlive(rt)
	rt = nil
	waitFor(t, "identity released after its round tripper", func() bool {
		runtime.GC()
		return p.Stats().Identities == 0
	})

	rt, err = p.TransportFor(f.srv.RestConfig(f.alice))
	must(t, err)
	must(t, p.Close())
	if _, err := getVia(rt, f.srv.URL()+"/version"); !errors.Is(err, ErrClosed) {
		t.Errorf("request after Close: %v, want ErrClosed", err)
	}
	if _, err := p.TransportFor(f.srv.RestConfig(f.alice)); !errors.Is(err, ErrClosed) {
		t.Errorf("TransportFor on a closed pool: %v, want ErrClosed", err)
	}
	if _, err := p.HTTPClientFor(f.srv.RestConfig(f.alice)); !errors.Is(err, ErrClosed) {
		t.Errorf("HTTPClientFor on a closed pool: %v, want ErrClosed", err)
	}
}

// sendBoth sends one request to host through p.TransportFor(cfg) and one
// through rest.TransportFor(control), and returns what the server saw of each.
func sendBoth(t *testing.T, log *requestLog, p *Pool, cfg, control *rest.Config, host, name string) (pool, clientGo testserver.RequestInfo) {
	t.Helper()
	// The wrappers the cases put in WrapTransport (a header, the hook of a
	// pool) leave connections alone: declared so.
	rt, err := p.TransportFor(cfg, WithPerRequestWrappers())
	must(t, err)
	controlRT, err := rest.TransportFor(control)
	must(t, err)
	for via, rt := range map[string]http.RoundTripper{"pool": rt, "client-go": controlRT} {
		if code, err := getVia(rt, host+"/version?case="+url.QueryEscape(name+"/"+via)); err != nil || code != http.StatusOK {
			t.Fatalf("through %s: %d %v", via, code, err)
		}
	}
	return log.get(t, name+"/pool"), log.get(t, name+"/client-go")
}

// TestTransportForUnwrapped: code that unwraps an HTTPClientFor client to
// the *http.Transport below it and changes that in place (its proxy, its
// client certificate) sees the change take effect, as through client-go
// alone, and the change reaches no other client of the pool: another client
// of the same config, built after, is seen as before. With and without
// Proxy.
func TestTransportForUnwrapped(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	bob, err := f.bob.TLSCertificate()
	must(t, err)
	change := func(hc *http.Client) {
		tr := unwrapToTransport(hc.Transport)
		if tr == nil {
			t.Fatalf("no *http.Transport under %T", hc.Transport)
		}
		tr.Proxy = proxyTo(r.proxies[1])
		tr.TLSClientConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &bob, nil }
	}
	for name, proxy := range map[string]func(*http.Request) (*url.URL, error){
		"Proxy":    proxyTo(r.proxies[0]),
		"no Proxy": nil,
	} {
		t.Run(name, func(t *testing.T) {
			p := newPool(t)
			cfg := r.srv.RestConfig(f.alice)
			cfg.Proxy = proxy
			was := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
			if proxy != nil {
				was.Via = "proxy 1"
			}
			pool := func(cfg *rest.Config) (*http.Client, error) { return p.HTTPClientFor(cfg, WithPerRequestWrappers()) }
			for _, side := range []struct {
				name  string
				build func(*rest.Config) (*http.Client, error)
			}{{"through the pool", pool}, {"through client-go alone", rest.HTTPClientFor}} {
				changed := r.clientBy(cfg, func(cfg *rest.Config) (*kubernetes.Clientset, error) {
					hc, err := side.build(cfg)
					if err != nil {
						return nil, err
					}
					change(hc)
					return kubernetes.NewForConfigAndClient(cfg, hc)
				})
				if o := changed.observe(); o != (observation{CN: "bob", Proto: h2, Gzip: true, Via: "proxy 2"}) {
					t.Errorf("%s, the changed client: %+v, want bob through proxy 2", side.name, o)
				}
				other := r.clientBy(cfg, func(cfg *rest.Config) (*kubernetes.Clientset, error) {
					hc, err := side.build(cfg)
					if err != nil {
						return nil, err
					}
					return kubernetes.NewForConfigAndClient(cfg, hc)
				})
				// Without Proxy, client-go alone hands every client of the
				// config its one cached transport, changed for all of them;
				// the pool's other clients keep the shared one.
				if o := other.observe(); o != was && (proxy != nil || side.name == "through the pool") {
					t.Errorf("%s, another client: %+v, want %+v", side.name, o, was)
				}
			}
			if st := p.Stats(); st.PassThrough != 1 || st.Identities != 1 {
				t.Errorf("pool %+v, want 1 client passed through and 1 identity", st)
			}
		})
	}
}

// TestTransportForAsksProxyPerRequest: a config's Proxy function is asked
// for every request, as net/http asks it over HTTP/1.1, and each request
// goes the way the answer for it says; an error fails that request alone.
// The control is client-go alone over HTTP/1.1 (DISABLE_HTTP2), where
// net/http asks per request; the pool does the same over HTTP/2, where
// net/http would ask only when it dials (beyond once when the config is
// given, to key its identity).
func TestTransportForAsksProxyPerRequest(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	proxies := []*connectProxy{newConnectProxy(t), newConnectProxy(t)}
	var urls []*url.URL
	for _, p := range proxies {
		u, err := url.Parse(p.url())
		must(t, err)
		urls = append(urls, u)
	}
	via := func(t *testing.T, path string) string {
		ri, ok := f.srv.LastRequest(path)
		if !ok {
			t.Fatalf("the server saw no request for %s", path)
		}
		for i, p := range proxies {
			if _, ok := p.Carried(ri.RemoteAddr, f.srv.Addr()); ok {
				return fmt.Sprint("proxy ", i+1)
			}
		}
		return "direct"
	}
	const control = "client-go alone, HTTP/1.1"
	sides := []struct {
		name, disableHTTP2 string
		newRT              func(*Pool, *rest.Config) (http.RoundTripper, error)
	}{
		{control, "1", func(_ *Pool, cfg *rest.Config) (http.RoundTripper, error) { return rest.TransportFor(cfg) }},
		{"pool, HTTP/2", "", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) { return p.TransportFor(cfg) }},
		{"pool, HTTP/1.1", "1", func(p *Pool, cfg *rest.Config) (http.RoundTripper, error) { return p.TransportFor(cfg) }},
	}
	t.Run("a function that fails for a while", func(t *testing.T) {
		type result struct {
			failedWhile, failedAfter int
			calls                    int64
		}
		results := map[string]result{}
		for _, side := range sides {
			t.Setenv("DISABLE_HTTP2", side.disableHTTP2)
			var failing atomic.Bool
			var n atomic.Int64
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = func(*http.Request) (*url.URL, error) {
				n.Add(1)
				if failing.Load() {
					return nil, errors.New("no proxy for you")
				}
				return urls[0], nil
			}
			rt, err := side.newRT(newPool(t), cfg)
			must(t, err)
			if code, err := getVia(rt, f.srv.URL()+"/version"); err != nil || code >= 500 {
				t.Fatalf("%s, the first request: %d %v", side.name, code, err)
			}
			var r result
			failing.Store(true)
			for range 6 {
				if _, err := getVia(rt, f.srv.URL()+"/api/v1/nodes"); err != nil {
					r.failedWhile++
				}
			}
			failing.Store(false)
			for range 2 {
				if _, err := getVia(rt, f.srv.URL()+"/api/v1/nodes"); err != nil {
					r.failedAfter++
				}
			}
			r.calls = n.Load()
			results[side.name] = r
			utilnet.CloseIdleConnectionsFor(rt)
		}
		t.Logf("6 requests while the function fails, 2 after: %+v", results)
		want := results[control]
		for _, side := range sides[1:] {
			got := results[side.name]
			if got.failedWhile != want.failedWhile || got.failedAfter != want.failedAfter {
				t.Errorf("%s: %d failed while the function failed and %d after; %s: %d and %d", side.name, got.failedWhile, got.failedAfter, control, want.failedWhile, want.failedAfter)
			}
			if got.calls < want.calls || got.calls > want.calls+1 {
				t.Errorf("%s: the function was asked %d times, %s %d (the pool asks once more, for the identity)", side.name, got.calls, control, want.calls)
			}
		}
	})
	t.Run("a function that routes by path", func(t *testing.T) {
		byPath := func(req *http.Request) (*url.URL, error) {
			if strings.HasPrefix(req.URL.Path, "/api/") {
				return urls[0], nil
			}
			return urls[1], nil
		}
		for _, first := range []string{"/api/v1/nodes", "/version"} {
			vias := map[string]string{}
			for _, side := range sides {
				t.Setenv("DISABLE_HTTP2", side.disableHTTP2)
				cfg := f.srv.RestConfig(f.alice)
				cfg.Proxy = byPath
				rt, err := side.newRT(newPool(t), cfg)
				must(t, err)
				var got []string
				for _, path := range []string{first, "/apis/apps/v1", "/api/v1/pods", "/version", "/api/v1/nodes"} {
					if code, err := getVia(rt, f.srv.URL()+path); err != nil || code >= 500 {
						t.Fatalf("%s %s: %d %v", side.name, path, code, err)
					}
					got = append(got, path+" "+via(t, path))
				}
				vias[side.name] = strings.Join(got, ", ")
				utilnet.CloseIdleConnectionsFor(rt)
			}
			for _, side := range sides[1:] {
				if vias[side.name] != vias[control] {
					t.Errorf("first %s: %s %s; %s %s", first, side.name, vias[side.name], control, vias[control])
				}
			}
		}
	})
}

// TestProxyAnswerMoves: HTTPClientFor of a config whose Proxy function reads
// the route from a setting. The setting moves from proxy 1 to proxy 2, and
// proxy 1 stops taking new tunnels while its tunnel stays open; the server
// holds 100 requests on that connection, so the next request needs a new
// one. client-go alone asks the function when it dials and goes through
// proxy 2; so does the pool, which asks for every request.
func TestProxyAnswerMoves(t *testing.T) {
	for _, pooled := range []bool{false, true} {
		t.Run(fmt.Sprint("pool ", pooled), func(t *testing.T) {
			hold := newRequestHold(t)
			f := newFixture(t, testserver.Options{OnRequest: hold.onRequest})
			proxies := []*connectProxy{newConnectProxy(t), newConnectProxy(t)}
			var setting atomic.Int32
			cfg := f.srv.RestConfig(f.alice)
			cfg.Proxy = func(*http.Request) (*url.URL, error) { return url.Parse(proxies[setting.Load()].url()) }
			client := clientGoClient(t, cfg)
			if pooled {
				client = httpClient(t, newPool(t), cfg)
			}
			if _, err := getUA(context.Background(), client, f.srv.URL(), "through proxy 1"); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			release := sendHeld(ctx, t, hold, client, f.srv.URL(), 100)
			defer release()
			waitFor(t, "the server holds 100 requests", func() bool { return hold.held.Load() == 100 })
			setting.Store(1)
			must(t, proxies[0].StopAccepting())
			moved, cancelMoved := context.WithTimeout(ctx, 10*time.Second)
			defer cancelMoved()
			_, err := getUA(moved, client, f.srv.URL(), "after the move")
			t.Logf("pool %v: after the setting moved to proxy 2 and proxy 1 stopped taking tunnels: %v; proxy 2 opened %d tunnels", pooled, err, proxies[1].Stats().Tunnels)
			if err != nil || proxies[1].Stats().Tunnels != 1 {
				t.Errorf("pool %v: a request after the move: %v, %d tunnels through proxy 2; want it served through proxy 2", pooled, err, proxies[1].Stats().Tunnels)
			}
		})
	}
}

// TestUnwrapDuringRotation: while a client's CA file is being rewritten,
// utilnet.TLSClientConfig unwraps an HTTPClientFor client, and again once
// the file is whole, as apimachinery's UpgradeAwareHandler unwraps. client-go
// alone built its transport with the client and answers both. The pool
// builds client-go's transport at the unwrap, and from a torn file builds it
// from what the client was built with, the material it holds: both unwraps
// answer, and every request is served.
func TestUnwrapDuringRotation(t *testing.T) {
	for _, pooled := range []bool{false, true} {
		t.Run(fmt.Sprint("pool ", pooled), func(t *testing.T) {
			f := newFixture(t, testserver.Options{})
			d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
			cfg := d.config(f.srv.URL())
			var client *http.Client
			if pooled {
				var err error
				client, err = newPool(t, WithPollInterval(0)).HTTPClientFor(cfg)
				must(t, err)
			} else {
				client = clientGoClient(t, cfg)
			}
			ctx := context.Background()
			if _, err := getUA(ctx, client, f.srv.URL(), "before"); err != nil {
				t.Fatal(err)
			}
			ca := f.ca.CertPEM()
			must(t, os.WriteFile(d.ca, ca[:len(ca)/2], 0o600)) // rewritten in place, half written
			_, tornErr := utilnet.TLSClientConfig(client.Transport)
			_, duringErr := getUA(ctx, client, f.srv.URL(), "while torn")
			d.write(t, f.alice, ca)
			_, wholeErr := utilnet.TLSClientConfig(client.Transport)
			var failed int
			for range 5 {
				if _, err := getUA(ctx, client, f.srv.URL(), "after"); err != nil {
					failed++
				}
			}
			t.Logf("pool %v: unwrap while the CA file was torn: %v; a request then: %v; unwrap once whole: %v; %d of 5 requests after failed", pooled, tornErr, duringErr, wholeErr, failed)
			if tornErr != nil || duringErr != nil || wholeErr != nil || failed > 0 {
				t.Errorf("pool %v: the unwrap while the CA file was torn: %v; a request then: %v; the unwrap once it was whole: %v; %d of 5 requests after failed; want none", pooled, tornErr, duringErr, wholeErr, failed)
			}
		})
	}
}
