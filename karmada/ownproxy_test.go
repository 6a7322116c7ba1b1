package karmada

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	fakeclient "sigs.k8s.io/controller-runtime/pkg/client/fake"

	clusterapis "github.com/karmada-io/karmada/pkg/apis/cluster"
	clusterv1alpha1 "github.com/karmada-io/karmada/pkg/apis/cluster/v1alpha1"
	"github.com/karmada-io/karmada/pkg/util"
	"github.com/karmada-io/karmada/pkg/util/gclient"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/chart"
	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/klogcapture"
	"github.com/sharedtransport/sharedtransport/internal/spdyecho"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// The tests in this file run Karmada's own code as the build has it: as is
// (go test), or from Karmada's source with karmada/patches applied
// (karmada/hack/test-patched.sh, build tag karmada_patched). patched says
// which; clusterTransports (patched only) sets the pool the patched
// ConnectCluster takes its transports from.

// TestOwnConnectClusterSeedLoad is the seed's load through Karmada's own
// ConnectCluster, called per request as the cluster proxy calls it: a
// tunnel per request as is; patched, about as many tunnels as Go's
// transport as Karmada builds it opens when one is shared by every request
// (medians of three rounds, interleaved), none refused or lost, every
// request seen as its own user, and a watch through the patched proxy that
// outlives the load on the load's tunnels. The median round is charted.
func TestOwnConnectClusterSeedLoad(t *testing.T) {
	name, order, rounds := "as is", 1, 1
	if patched {
		name, order, rounds = "patched", 2, 3
	}
	var rows []row
	var control []uint64
	for range rounds {
		rows = append(rows, runOwnConnectCluster(t))
		if patched {
			control = append(control, runSeedMode(t, sharedOnce).tunnels)
		}
	}
	var tunnels []uint64
	for _, r := range rows {
		tunnels = append(tunnels, r.tunnels)
	}
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(a.tunnels, b.tunnels) })
	r := rows[len(rows)/2]
	t.Logf("\n| %s's ConnectCluster | tunnels | open after the load | full handshakes | resumed | refused | lost | req/s | test-process CPU per request |\n|---|---|---|---|---|---|---|---|---|", karmadaRelease)
	t.Logf("| %s | %d | %d | %d | %d | %d | %d | %.0f | %.2f ms |", name, r.tunnels, r.openAtEnd, r.handshakes, r.resumed, r.refused, r.lost+r.wrong, r.reqPerSec, r.cpuPerReq)
	if patched {
		checkTunnelsAsShared(t, "ConnectCluster patched", tunnels, control)
	}
	peak := 0
	for _, p := range r.tunnelsOpen {
		peak = max(peak, p.Open)
	}
	keepRun(t, order, chart.Series{Name: name, Points: r.tunnelsOpen,
		End: fmt.Sprintf("%d tunnel(s), peak %d open", r.tunnels, peak)})
}

func runOwnConnectCluster(t *testing.T) row {
	var pool *sharedtransport.Pool
	if patched {
		pool = sharedtransport.New()
		t.Cleanup(clusterTransports(pool))
	}
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	url := serveFront(t, &front{mode: connectCluster, secrets: sec, cluster: cl})
	var w *watch
	if patched {
		w = startWatch(t, url)
	}
	stopSampling := sampleTunnels(proxy)
	loadStart := time.Now()
	res := load(t, url, seedClients, seedRequests)
	points := stopSampling()
	st := proxy.Stats()
	total := int64(seedClients * seedRequests)
	r := row{mode: connectCluster, tunnels: st.Tunnels, refused: st.Rejected, openAtEnd: st.Open, ok: res.ok, lost: res.failed, wrong: res.wrongUser,
		reqPerSec: float64(total) / res.elapsed.Seconds(), cpuPerReq: float64(res.cpu.Milliseconds()) / float64(total), handshakes: st.Tunnels,
		tunnelsOpen: points}
	if pool != nil {
		ps := pool.Stats()
		r.handshakes, r.resumed = ps.Handshakes, ps.Resumptions
	}
	if res.ok != total || st.Rejected != 0 {
		t.Errorf("%d of %d requests right, %d failed, %d seen as another user, %d tunnels refused; first: %v",
			res.ok, total, res.failed, res.wrongUser, st.Rejected, res.firstErr.Load())
	}
	if !patched && st.Tunnels != uint64(total) {
		t.Errorf("as is: %d tunnels for %d requests, want one per request:%s", st.Tunnels, total, timeline(proxy, loadStart))
	}
	if w != nil {
		w.wantEvent(t, fmt.Sprintf("own-after-the-load-%d", time.Now().UnixNano()))
		if n := proxy.Stats().Tunnels; n > st.Tunnels {
			t.Errorf("the watch's event came over a new tunnel (%d, %d after the load)", n, st.Tunnels)
		}
	}
	return r
}

// timeline says when each tunnel of p opened and closed, and by which end,
// from start: a surplus connection Go closes on arrival shows as one the
// client closed a few milliseconds after it opened.
func timeline(p *connectproxy.Proxy, start time.Time) string {
	var b strings.Builder
	for i, tn := range p.Tunnels() {
		fmt.Fprintf(&b, "\n\ttunnel %d: opened at %v", i+1, tn.Opened.Sub(start).Round(time.Millisecond))
		if tn.ClosedBy != "" {
			fmt.Fprintf(&b, ", closed by the %s at %v", tn.ClosedBy, tn.Closed.Sub(start).Round(time.Millisecond))
		}
	}
	return b.String()
}

// TestOwnConnectClusterCABundleChange: a new caBundle in the cluster's
// Secret takes effect on the next request through Karmada's ConnectCluster:
// a bundle without the member's CA fails at once, one with it works at once.
func TestOwnConnectClusterCABundleChange(t *testing.T) {
	if patched {
		pool := sharedtransport.New()
		t.Cleanup(clusterTransports(pool))
	}
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	url := serveFront(t, &front{mode: connectCluster, secrets: sec, cluster: cl})
	hc := httpClient()
	for i := range 3 {
		if _, err := whoAmI(context.Background(), hc, url, fmt.Sprintf("a%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	other, err := testserver.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	sec.setCABundle("member1", other.CertPEM())
	if _, err := whoAmI(context.Background(), hc, url, "b"); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("with a caBundle without the member's CA: %v, want unknown authority", err)
	}
	sec.setCABundle("member1", append(other.CertPEM(), kube.ServingCA.CertPEM()...))
	if got, err := whoAmI(context.Background(), hc, url, "c"); err != nil || got != "c" {
		t.Errorf("with both CAs: %q, %v", got, err)
	}
	want := uint64(5) // as is: a tunnel per request
	if patched {
		want = 3 // one per bundle
	}
	if n := proxy.Stats().Tunnels; n != want {
		t.Errorf("%d tunnels for 5 requests over three bundles, want %d", n, want)
	}
}

// TestOwnConnectClusterSettingsChange: the cluster's other settings change
// between requests, each taken on the next request through Karmada's
// ConnectCluster, as is and patched: a new ProxyHeader goes on the next
// tunnel (the old tunnel, opened with the old header, is not reused), and
// InsecureSkipTLSVerification turned on and off again is honoured at once
// with a caBundle that does not hold the member's CA.
func TestOwnConnectClusterSettingsChange(t *testing.T) {
	if patched {
		pool := sharedtransport.New()
		t.Cleanup(clusterTransports(pool))
	}
	rotated := "Basic " + "bWVtYmVyMTpyb3RhdGVk" // member1:rotated
	proxy, err := connectproxy.Start(connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: []string{proxyToken, rotated}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	f := &front{mode: connectCluster, secrets: sec, cluster: cl}
	url := serveFront(t, f)
	hc := httpClient()
	ask := func(user string) error {
		got, err := whoAmI(context.Background(), hc, url, user)
		if err == nil && got != user {
			err = fmt.Errorf("the member saw %q", got)
		}
		return err
	}
	change := func(edit func(*clusterapis.Cluster)) {
		f.mu.Lock()
		edit(f.cluster)
		f.mu.Unlock()
	}
	if err := ask("before"); err != nil {
		t.Fatal(err)
	}
	change(func(c *clusterapis.Cluster) { c.Spec.ProxyHeader = map[string]string{"Proxy-Authorization": rotated} })
	if err := ask("new header"); err != nil {
		t.Fatal(err)
	}
	tunnels := proxy.Tunnels()
	if last := tunnels[len(tunnels)-1].Header.Get("Proxy-Authorization"); last != rotated {
		t.Errorf("the request after the ProxyHeader change went over a tunnel opened with %q", last)
	}
	other, err := testserver.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	sec.setCABundle("member1", other.CertPEM())
	change(func(c *clusterapis.Cluster) { c.Spec.InsecureSkipTLSVerification = true })
	if err := ask("insecure"); err != nil {
		t.Errorf("InsecureSkipTLSVerification with a caBundle without the member's CA: %v", err)
	}
	change(func(c *clusterapis.Cluster) { c.Spec.InsecureSkipTLSVerification = false })
	if err := ask("verified again"); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("InsecureSkipTLSVerification off again, a caBundle without the member's CA: %v, want unknown authority", err)
	}
	if st := proxy.Stats(); st.Rejected != 0 {
		t.Errorf("%d tunnels refused (407)", st.Rejected)
	}
}

// TestOwnConnectClusterExec: an exec (SPDY) through the handler Karmada's
// ConnectCluster returns: the upgrade goes through Karmada's own
// UpgradeDialer, through the proxy with the cluster's header, and the
// plain requests beside it share one tunnel when patched. The member is a
// SPDY echo (the e2e kube-apiserver has no kubelet to exec in).
func TestOwnConnectClusterExec(t *testing.T) {
	if patched {
		pool := sharedtransport.New()
		t.Cleanup(clusterTransports(pool))
	}
	echo, err := spdyecho.Start(map[string]string{token: "karmada-impersonator"})
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	proxy := newProxy(t)
	cl, sec := member("echo", echo.URL, proxy, echo.CA.CertPEM())
	url := serveFront(t, &front{mode: connectCluster, secrets: sec, cluster: cl})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const execs = 3
	for i := range execs {
		payload := fmt.Sprintf("ping %d", i)
		got, err := spdyecho.Exec(ctx, url+"/api/v1/namespaces/default/pods/p/exec", "", payload)
		if err != nil {
			t.Fatal(err)
		}
		if want := "hello karmada-impersonator\n" + payload; got != want {
			t.Errorf("exec said %q, want %q", got, want)
		}
	}
	if st := proxy.Stats(); st.Tunnels != execs || st.Rejected != 0 {
		t.Errorf("proxy %+v, want a tunnel per exec and none refused", st)
	}
}

// TestOwnClusterClientSets: the client sets Karmada's controllers build per
// reconcile (util.NewClusterClientSet, util.NewClusterDynamicClientSet) for
// two members behind one proxy, each with its own ProxyHeader: a tunnel per
// client set as is; patched, one per member, each with its member's header.
// A member reached directly has one connection either way: client-go's own
// cache shares its transport already.
func TestOwnClusterClientSets(t *testing.T) {
	const reconciles = 25
	creds := []string{"Basic b3duLWE=", "Basic b3duLWI="}
	m, proxy := newControllerMembers(t, creds...)
	var objs []client.Object
	for _, c := range m {
		objs = append(objs, c)
	}
	for _, c := range creds {
		objs = append(objs, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: secretNamespace, Name: c}, Data: m.secretData()})
	}
	// A member reached directly: a ProxyHeader without a ProxyURL goes
	// nowhere, as BuildClusterConfig has it. Its connections are counted by
	// a relay in front of the member.
	relay := newCountingRelay(t, strings.TrimPrefix(kube.URL, "https://"))
	direct := &clusterv1alpha1.Cluster{ObjectMeta: metav1.ObjectMeta{Name: "direct"}, Spec: clusterv1alpha1.ClusterSpec{
		APIEndpoint: "https://" + relay.addr(), SecretRef: &clusterv1alpha1.LocalSecretReference{Namespace: secretNamespace, Name: "direct"},
		ProxyHeader: map[string]string{"Proxy-Authorization": "Basic ZGlyZWN0"},
	}}
	objs = append(objs, direct, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: secretNamespace, Name: "direct"}, Data: m.secretData()})
	host := fakeclient.NewClientBuilder().WithScheme(gclient.NewSchema()).WithObjects(objs...).Build()
	ctx := context.Background()
	for i := range reconciles {
		cs, err := util.NewClusterClientSet("direct", host, nil)
		if err == nil {
			_, err = cs.KubeClient.CoreV1().ConfigMaps("default").List(ctx, metav1.ListOptions{Limit: 1})
		}
		var dyn *util.DynamicClusterClient
		if err == nil {
			dyn, err = util.NewClusterDynamicClientSet("direct", host, nil)
		}
		if err == nil {
			_, err = dyn.DynamicClientSet.Resource(corev1.SchemeGroupVersion.WithResource("configmaps")).Namespace("default").List(ctx, metav1.ListOptions{Limit: 1})
		}
		if err != nil {
			t.Fatalf("reconcile %d of the member reached directly: %v", i, err)
		}
	}
	// client-go's own cache already shares a transport for a config without
	// Proxy: one connection as is, and one patched.
	if n := relay.accepted(); n != 1 {
		t.Errorf("%d reconciles of the member reached directly, 2 client sets each: %d connections, want 1", reconciles, n)
	}
	for i := range reconciles {
		for _, c := range creds {
			cs, err := util.NewClusterClientSet(c, host, nil)
			if err != nil {
				t.Fatalf("reconcile %d of %s: %v", i, c, err)
			}
			if _, err := cs.KubeClient.CoreV1().ConfigMaps("default").List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
				t.Fatalf("reconcile %d of %s: %v", i, c, err)
			}
			dyn, err := util.NewClusterDynamicClientSet(c, host, nil)
			if err != nil {
				t.Fatalf("reconcile %d of %s: %v", i, c, err)
			}
			if _, err := dyn.DynamicClientSet.Resource(corev1.SchemeGroupVersion.WithResource("configmaps")).Namespace("default").List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
				t.Fatalf("reconcile %d of %s (dynamic): %v", i, c, err)
			}
		}
	}
	st := proxy.Stats()
	want := uint64(2 * reconciles * len(creds))
	if patched {
		want = uint64(len(creds))
	}
	if st.Tunnels != want || st.Rejected != 0 {
		t.Errorf("%d reconciles of each of %d members, 2 client sets each: %d tunnels, %d refused; want %d and 0", reconciles, len(creds), st.Tunnels, st.Rejected, want)
	}
	seen := map[string]int{}
	for _, tn := range proxy.Tunnels() {
		seen[tn.Header.Get("Proxy-Authorization")]++
	}
	for _, c := range creds {
		if seen[c] != int(want)/len(creds) {
			t.Errorf("tunnels by header %v, want %d for each member", seen, int(want)/len(creds))
		}
	}
	t.Logf("NewClusterClientSet + NewClusterDynamicClientSet, %d reconciles of each of %d members: %d tunnels, %d refused (407); of the member reached directly: %d connections", reconciles, len(creds), st.Tunnels, st.Rejected, relay.accepted())
}

// TestOwnConnectClusterLogsNoSecrets: with klog at -v=10, requests through
// Karmada's own ConnectCluster, as is and patched, one of them refused by
// the proxy for an old ProxyHeader and one failing on a caBundle without the
// member's CA, log neither the impersonator token nor the proxy credentials,
// and the errors the failed requests are answered with hold neither.
func TestOwnConnectClusterLogsNoSecrets(t *testing.T) {
	logs := klogcapture.Start(t, 10)
	if patched {
		pool := sharedtransport.New()
		t.Cleanup(clusterTransports(pool))
	}
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	f := &front{mode: connectCluster, secrets: sec, cluster: cl}
	url := serveFront(t, f)
	hc := httpClient()
	for i := range 3 {
		if _, err := whoAmI(context.Background(), hc, url, fmt.Sprintf("u%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	stale := "Basic " + "c3RhbGUtcHJveHktc2VjcmV0" // stale-proxy-secret
	f.mu.Lock()
	f.cluster.Spec.ProxyHeader = map[string]string{"Proxy-Authorization": stale}
	f.mu.Unlock()
	var answers []string // what the failed requests were answered: errors reach the caller
	if _, err := whoAmI(context.Background(), hc, url, "refused"); err == nil {
		t.Error("a request with a ProxyHeader the proxy refuses succeeded")
	} else {
		answers = append(answers, err.Error())
	}
	other, err := testserver.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	sec.setCABundle("member1", other.CertPEM())
	if _, err := whoAmI(context.Background(), hc, url, "unverified"); err == nil {
		t.Error("a request with a caBundle without the member's CA succeeded")
	} else {
		answers = append(answers, err.Error())
	}
	out := logs.String() + strings.Join(answers, "\n")
	for name, secret := range map[string]string{"impersonator token": token, "proxy credentials": proxyToken, "refused proxy credentials": stale,
		"proxy password": "proxy-secret", "refused proxy password": "stale-proxy-secret"} {
		if strings.Contains(out, secret) {
			t.Errorf("the %s appear in the log or in an error", name)
		}
	}
	t.Logf("%d bytes of log at -v=10", len(out))
}

// countingRelay forwards TCP connections to a member and counts them: the
// member's side of a client's connections.
type countingRelay struct {
	ln    net.Listener
	count atomic.Int64
}

func newCountingRelay(t testing.TB, target string) *countingRelay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &countingRelay{ln: ln}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.count.Add(1)
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			open = append(open, c, up)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); io.Copy(up, c); up.Close() }()
			go func() { defer wg.Done(); io.Copy(c, up); c.Close() }()
		}
	}()
	return r
}

func (r *countingRelay) addr() string { return r.ln.Addr().String() }

func (r *countingRelay) accepted() int64 { return r.count.Load() }
