package testserver

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		goleak.IgnoreAnyFunction("k8s.io/client-go/util/workqueue.(*Typed[...]).updateUnfinishedWorkLoop"),
	)
}

func start(t *testing.T, opts Options) *Server {
	t.Helper()
	s, err := Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

func clientFor(t *testing.T, s *Server, user string, groups ...string) (*KeyPair, *rest.Config) {
	t.Helper()
	kp, err := s.CA().IssueClient(user, groups...)
	if err != nil {
		t.Fatal(err)
	}
	return kp, s.RestConfig(kp)
}

// ownTransport gives cfg a transport of its own so tests do not share
// client-go's global cache (and leak no idle connections across tests).
func ownTransport(t *testing.T, cfg *rest.Config, keepAliveOff bool) *http.Transport {
	t.Helper()
	tlsCfg, err := rest.TLSConfigFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: tlsCfg, ForceAttemptHTTP2: true, DisableKeepAlives: keepAliveOff}
	t.Cleanup(tr.CloseIdleConnections)
	cfg.Transport = tr
	cfg.QPS, cfg.Burst = 1000, 1000
	cfg.TLSClientConfig = rest.TLSClientConfig{}
	return tr
}

func TestListNodesSeesCertificate(t *testing.T) {
	s := start(t, Options{})
	_, cfg := clientFor(t, s, "alice", "team-a")
	ownTransport(t, cfg, false)
	cs := kubernetes.NewForConfigOrDie(cfg)
	for i := 0; i < 5; i++ {
		nodes, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(nodes.Items) != 3 || nodes.ResourceVersion == "" {
			t.Fatalf("got %d nodes, rv %q", len(nodes.Items), nodes.ResourceVersion)
		}
	}
	ri, ok := s.LastRequest("/api/v1/nodes")
	if !ok || ri.CertCN != "alice" || ri.User != "alice" || ri.Proto != "HTTP/2.0" || len(ri.CertGroups) != 1 {
		t.Fatalf("last request: %+v", ri)
	}
	st := s.Stats()
	if st.Accepted != 1 || st.Open != 1 || st.PeakOpen != 1 || st.FullHandshakes != 1 || st.Requests != 5 {
		t.Fatalf("stats: %+v", st)
	}
	v, err := cs.Discovery().ServerVersion()
	if err != nil || v.Major != "1" {
		t.Fatalf("version %v %v", v, err)
	}
	if _, err := cs.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = cs.CoreV1().Nodes().Get(context.Background(), "nope", metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		t.Fatalf("want NotFound, got %v", err)
	}
	res, err := cs.Discovery().ServerResourcesForGroupVersion("v1")
	if err != nil || len(res.APIResources) < 10 {
		t.Fatalf("discovery: %v %v", res, err)
	}
	ssr, err := cs.AuthenticationV1().SelfSubjectReviews().Create(context.Background(), nil, metav1.CreateOptions{})
	if err != nil || ssr.Status.UserInfo.Username != "alice" {
		t.Fatalf("selfsubjectreview: %+v %v", ssr, err)
	}
}

func TestInformersSync(t *testing.T) {
	s := start(t, Options{BookmarkInterval: 50 * time.Millisecond})
	_, cfg := clientFor(t, s, "bob")
	ownTransport(t, cfg, false)
	cs := kubernetes.NewForConfigOrDie(cfg)
	f := informers.NewSharedInformerFactory(cs, 0)
	core := f.Core().V1()
	nodes := core.Nodes().Informer()
	for _, inf := range []cache.SharedIndexInformer{
		core.Namespaces().Informer(), core.Pods().Informer(), core.ConfigMaps().Informer(),
		core.Services().Informer(), core.Secrets().Informer(), core.Endpoints().Informer(),
		core.Events().Informer(), core.ServiceAccounts().Informer(), core.PersistentVolumes().Informer(),
	} {
		_ = inf
	}
	stop := make(chan struct{})
	defer f.Shutdown()
	defer close(stop)
	f.Start(stop)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			t.Fatalf("%v did not sync", typ)
		}
	}
	if n := len(nodes.GetStore().List()); n != 3 {
		t.Fatalf("nodes in cache: %d", n)
	}
	// Wait for the watches to be established.
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Watches < 10 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// A fresh transport dials once per concurrent first request (the cold-start
	// storm); the surplus is closed and one connection carries everything.
	for s.OpenConns() > 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := s.Stats(); st.Watches < 10 || st.Open != 1 {
		t.Fatalf("stats: %+v", st)
	}
	time.Sleep(150 * time.Millisecond) // a few bookmarks
}

func TestWatchInitialEventsAndStop(t *testing.T) {
	s := start(t, Options{})
	_, cfg := clientFor(t, s, "carol")
	ownTransport(t, cfg, false)
	cs := kubernetes.NewForConfigOrDie(cfg)
	send := true
	w, err := cs.CoreV1().Namespaces().Watch(context.Background(), metav1.ListOptions{
		SendInitialEvents: &send, AllowWatchBookmarks: true, ResourceVersionMatch: metav1.ResourceVersionMatchNotOlderThan,
	})
	if err != nil {
		t.Fatal(err)
	}
	var added int
	for ev := range w.ResultChan() {
		if ev.Type == "ADDED" {
			added++
			continue
		}
		if ev.Type != "BOOKMARK" {
			t.Fatalf("event %v", ev.Type)
		}
		if ev.Object.(*corev1.Namespace).Annotations["k8s.io/initial-events-end"] != "true" {
			t.Fatalf("bookmark without initial-events-end")
		}
		break
	}
	if added != 4 {
		t.Fatalf("added %d", added)
	}
	// Stopping the server ends the watch.
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	select {
	case _, ok := <-w.ResultChan():
		for ok {
			_, ok = <-w.ResultChan()
		}
	case <-time.After(10 * time.Second):
		t.Fatal("watch did not end on restart")
	}
	w.Stop()
	// Served again on the same address.
	if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Accepted != 2 {
		t.Fatalf("stats after restart: %+v", st)
	}
}

func TestConnectionCounting(t *testing.T) {
	for _, v := range []uint16{tls.VersionTLS12, tls.VersionTLS13} {
		s := start(t, Options{MaxTLSVersion: v})
		_, cfg := clientFor(t, s, "dave")
		tr := ownTransport(t, cfg, true)
		tr.TLSClientConfig.ClientSessionCache = tls.NewLRUClientSessionCache(8)
		cs := kubernetes.NewForConfigOrDie(cfg)
		for i := 0; i < 10; i++ {
			if _, err := cs.CoreV1().Namespaces().List(context.Background(), metav1.ListOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		st := s.Stats()
		if st.Accepted != 10 || st.FullHandshakes != 1 || st.ResumedHandshakes != 9 {
			t.Fatalf("TLS %x keep-alive off with session cache: %+v", v, st)
		}
		reqs := s.Requests()
		if len(reqs) != 10 || reqs[0].Resumed || !reqs[9].Resumed || reqs[9].CertCN != "dave" || reqs[9].TLSVersion != v {
			t.Fatalf("requests: %+v", reqs)
		}
		s.ResetStats()
		if st := s.Stats(); st.Accepted != 0 || st.Requests != 0 || len(s.Requests()) != 0 {
			t.Fatalf("after reset: %+v", st)
		}
	}
}

func TestConcurrentStreamsLimit(t *testing.T) {
	s := start(t, Options{MaxConcurrentStreams: 10, Latency: 100 * time.Millisecond})
	_, cfg := clientFor(t, s, "erin")
	tr := ownTransport(t, cfg, false)
	tr.MaxConnsPerHost = 1 // gates dials, so the count is the physical minimum
	cs := kubernetes.NewForConfigOrDie(cfg)
	var wg sync.WaitGroup
	errs := make(chan error, 30)
	for i := 0; i < 30; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// 30 concurrent requests, 10 streams each: at least 3 connections.
	if st := s.Stats(); st.Accepted < 3 || st.PeakOpen < 3 || st.Requests != 30 {
		t.Fatalf("stats: %+v", st)
	}
}

func TestGoaway(t *testing.T) {
	s := start(t, Options{GoawayChance: 1})
	_, cfg := clientFor(t, s, "frank")
	ownTransport(t, cfg, false)
	cs := kubernetes.NewForConfigOrDie(cfg)
	for i := 0; i < 5; i++ {
		if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if st := s.Stats(); st.Goaways != 5 || st.Accepted != 5 {
		t.Fatalf("stats: %+v", st)
	}
	s.SetGoawayChance(0)
	s.ResetStats()
	for i := 0; i < 5; i++ {
		if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The connection dialed to replace the last GOAWAY'd one may be
	// accepted after the reset: at most it and one more.
	if st := s.Stats(); st.Goaways != 0 || st.Accepted > 2 {
		t.Fatalf("stats: %+v", st)
	}
}

func TestAuth(t *testing.T) {
	s := start(t, Options{
		ClientAuth: VerifyClientCertIfGiven,
		Tokens:     map[string]string{"tok-1": "tokenuser"},
		Authorize:  func(a Attributes) bool { return a.User != "mallory" },
	})
	dir := t.TempDir()
	// Token only, file-based kubeconfig without a client certificate.
	p, err := WriteKubeconfig(filepath.Join(dir, "token.kubeconfig"), Kubeconfig{Server: s.URL(), CAPEM: s.CA().CertPEM(), Token: "tok-1"})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", p.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	ownTransport(t, cfg, false)
	cs := kubernetes.NewForConfigOrDie(cfg)
	if _, err := cs.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if ri, _ := s.LastRequest(""); ri.User != "tokenuser" || ri.Token != "tok-1" || ri.CertCN != "" {
		t.Fatalf("request: %+v", ri)
	}
	cfg.BearerToken = "wrong"
	cs = kubernetes.NewForConfigOrDie(cfg)
	if _, err := cs.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{}); !apierrors.IsUnauthorized(err) {
		t.Fatalf("want Unauthorized, got %v", err)
	}

	// Certificate files on disk, and a forbidden user.
	kp, err := s.CA().IssueClient("mallory")
	if err != nil {
		t.Fatal(err)
	}
	p, err = s.WriteKubeconfig(filepath.Join(dir, "mallory.kubeconfig"), kp, false)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p.Kubeconfig); !strings.Contains(string(b), "client-certificate: "+p.Cert) {
		t.Fatalf("kubeconfig:\n%s", b)
	}
	cfg, err = clientcmd.BuildConfigFromFlags("", p.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	ownTransport(t, cfg, false)
	cs = kubernetes.NewForConfigOrDie(cfg)
	_, err = cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), `User "mallory" cannot list resource "nodes"`) {
		t.Fatalf("want Forbidden, got %v", err)
	}
	if st := s.Stats(); st.Forbidden != 1 || st.Unauthorized != 1 {
		t.Fatalf("stats: %+v", st)
	}
}

func TestRequireClientCertRejectsNoCert(t *testing.T) {
	s := start(t, Options{})
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: s.CA().Pool()}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get(s.URL() + "/version")
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		t.Fatal("request without a client certificate succeeded")
	}
}

func TestInlineKubeconfig(t *testing.T) {
	s := start(t, Options{})
	kp, _ := clientFor(t, s, "grace")
	p, err := s.WriteKubeconfig(filepath.Join(t.TempDir(), "kc"), kp, true)
	if err != nil {
		t.Fatal(err)
	}
	if p.Cert != "" {
		t.Fatalf("inline wrote files: %+v", p)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", p.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.CertData) == 0 || len(cfg.CAData) == 0 {
		t.Fatalf("the config has %d bytes of CertData and %d of CAData, want both", len(cfg.CertData), len(cfg.CAData))
	}
	ownTransport(t, cfg, false)
	if _, err := kubernetes.NewForConfigOrDie(cfg).CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
}
