package connectproxy

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

// clientThrough is a clientset of the server's CA and a client certificate
// for alice whose connections go through proxy, their CONNECT carrying
// header.
func clientThrough(t *testing.T, srv *testserver.Server, proxy *Proxy, header http.Header) (kubernetes.Interface, *http.Transport) {
	t.Helper()
	kp, err := srv.CA().IssueClient("alice")
	if err != nil {
		t.Fatal(err)
	}
	cfg := srv.RestConfig(kp)
	tlsCfg, err := rest.TLSConfigFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(proxy.URL())
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: tlsCfg, ForceAttemptHTTP2: true, Proxy: http.ProxyURL(u), ProxyConnectHeader: header}
	t.Cleanup(tr.CloseIdleConnections)
	cfg.Transport, cfg.TLSClientConfig = tr, rest.TLSClientConfig{}
	cfg.QPS, cfg.Burst = 1000, 1000
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs, tr
}

func listNodes(cs kubernetes.Interface) error {
	_, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
	return err
}

// A proxy that requires a header: requests with it share one tunnel (HTTP/2
// over it), which the server's view of its peer finds with its header; a
// CONNECT without it is refused with 407 and never reaches the server.
// Counted by the proxy and by the server.
func TestRequiredHeader(t *testing.T) {
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	p, err := Start(Options{RequireHeader: "Proxy-Authorization", RequireValues: []string{"Basic a", "Basic b"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	cs, _ := clientThrough(t, srv, p, http.Header{"Proxy-Authorization": {"Basic b"}})
	// One request first: a cold http.Transport dials per concurrent request.
	if err := listNodes(cs); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for range 40 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- listNodes(cs) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if st, sst := p.Stats(), srv.Stats(); st.Tunnels != 1 || st.Rejected != 0 || st.Open != 1 || st.Accepted != 1 || sst.Accepted != 1 {
		t.Fatalf("proxy %+v, server accepted %d; want 1 tunnel open, 0 refused, 1 connection at the server", st, sst.Accepted)
	}
	last, ok := srv.LastRequest("/api/v1/nodes")
	if !ok {
		t.Fatal("the server saw no list")
	}
	tun, ok := p.Carried(last.RemoteAddr, srv.Addr())
	if !ok {
		t.Fatalf("no open tunnel has the server's peer %s: %+v", last.RemoteAddr, p.Tunnels())
	}
	if got := tun.Header.Get("Proxy-Authorization"); got != "Basic b" || tun.Target != srv.Addr() {
		t.Errorf("tunnel %+v: want target %s and the client's header", tun, srv.Addr())
	}
	if _, ok := p.Carried(last.RemoteAddr, "127.0.0.1:1"); ok {
		t.Error("Carried matched a tunnel to another server")
	}

	for _, h := range []http.Header{nil, {"Proxy-Authorization": {"Basic c"}}} {
		cs, _ := clientThrough(t, srv, p, h)
		if err := listNodes(cs); err == nil || !strings.Contains(err.Error(), "Proxy Authentication Required") {
			t.Errorf("header %v: %v, want the proxy's 407", h, err)
		}
	}
	if st, sst := p.Stats(), srv.Stats(); st.Tunnels != 1 || st.Rejected != 2 || sst.Accepted != 1 {
		t.Errorf("proxy %+v, server accepted %d; want 2 refused that never reached the server", st, sst.Accepted)
	}

	// A proxy restart: the client opens a new tunnel, seen in order.
	if n := p.CloseTunnels(); n != 1 {
		t.Errorf("closed %d tunnels, want 1", n)
	}
	if err := listNodes(cs); err != nil {
		t.Fatal(err)
	}
	if tunnels := p.Tunnels(); len(tunnels) != 2 || tunnels[0].Upstream == tunnels[1].Upstream || p.Stats().Tunnels != 2 {
		t.Errorf("tunnels %+v, want 2 on different connections", tunnels)
	}
	p.ResetStats()
	if st := p.Stats(); st.Tunnels != 0 || st.Rejected != 0 || st.Accepted != 0 || st.Open != 1 || len(p.Tunnels()) != 0 {
		t.Errorf("after ResetStats: %+v, %d tunnels; want zero counts and the open tunnel kept", st, len(p.Tunnels()))
	}
}

// Other requests than CONNECT get 405; an unreachable target 502. Close
// ends open tunnels and may be called twice (goleak checks the goroutines).
func TestNotConnectAndClose(t *testing.T) {
	p, err := Start(Options{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(p.URL() + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %s, want 405", resp.Status)
	}
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr()
	cs, tr := clientThrough(t, srv, p, nil)
	if err := listNodes(cs); err != nil {
		t.Fatal(err)
	}
	srv.Close()
	tr.CloseIdleConnections()
	if err := listNodes(cs); err == nil || !strings.Contains(err.Error(), "Bad Gateway") {
		t.Errorf("server gone: %v, want 502", err)
	}
	if st := p.Stats(); st.Tunnels != 1 || st.Failed != 2 {
		t.Errorf("%+v, want 1 tunnel to %s and 2 failed", st, addr)
	}
	if err := p.Close(); err != nil {
		t.Error(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// A name only the proxy resolves: a CONNECT for it reaches the address
// Hosts gives; a name it does not know fails at the proxy (502).
func TestHosts(t *testing.T) {
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	_, port, _ := strings.Cut(srv.Addr(), "127.0.0.1:")
	p, err := Start(Options{Hosts: map[string]string{"api.internal.test": "127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for host, want := range map[string]string{"api.internal.test": "200", "other.internal.test": "502"} {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n", host, port, host, port)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		if err != nil {
			t.Fatalf("CONNECT %s: %v", host, err)
		}
		resp.Body.Close()
		if got := strconv.Itoa(resp.StatusCode); got != want {
			t.Errorf("CONNECT %s: %s, want %s", host, resp.Status, want)
		}
	}
	if st := p.Stats(); st.Tunnels != 1 || st.Failed != 1 {
		t.Errorf("proxy stats %+v, want 1 tunnel and 1 failed", st)
	}
}
