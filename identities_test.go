package sharedtransport

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"net/url"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// serverConns is the server's count, per client certificate CN, of the
// connections requests came on and of those that were resumed.
type serverConns struct {
	mu      sync.Mutex
	resumed map[string]map[string]bool // CN -> remote address -> resumed
}

func (s *serverConns) onRequest(ri testserver.RequestInfo) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resumed[ri.CertCN] == nil {
		s.resumed[ri.CertCN] = map[string]bool{}
	}
	s.resumed[ri.CertCN][ri.RemoteAddr] = ri.Resumed
}

// count returns the connections of the CNs, and how many were full and
// resumed handshakes.
func (s *serverConns) count(cns ...string) (conns, full, resumed uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, cn := range cns {
		for _, r := range s.resumed[cn] {
			conns++
			if r {
				resumed++
			} else {
				full++
			}
		}
	}
	return conns, full, resumed
}

func findIdentity(infos []IdentityInfo, pred func(IdentityInfo) bool) (IdentityInfo, bool) {
	i := slices.IndexFunc(infos, pred)
	if i < 0 {
		return IdentityInfo{}, false
	}
	return infos[i], true
}

// TestIdentitySnapshot: the per-identity snapshot, read without pause while
// identities come and go, a reload is rejected and a rotation taken, agrees
// with what the server counted for each identity: connections, full and
// resumed handshakes. Keep-alive is off, so every request has a connection
// of its own and the counts are exact.
func TestIdentitySnapshot(t *testing.T) {
	server := &serverConns{resumed: map[string]map[string]bool{}}
	f := newFixture(t, testserver.Options{OnRequest: server.onRequest})
	p := newPool(t, WithKeepAlive(false), WithIdleTimeout(0), withDebounce(10*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	dir := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	_, fileCS := dir.wrapped(t, p, f.srv.URL())
	proxy := newConnectProxy(t)
	password := randomSecret(t, "proxy-password-")
	proxyCfg := f.srv.RestConfig(f.bob)
	proxyURL, _ := url.Parse("http://someone:" + password + "@" + proxy.Addr())
	proxyCfg.Proxy = http.ProxyURL(proxyURL)
	proxyCS := mustPooled(t, p, proxyCfg)
	isFile := func(i IdentityInfo) bool { return len(i.Files) > 0 }
	isProxy := func(i IdentityInfo) bool { return strings.Contains(i.Proxy, proxy.Addr()) }

	// Readers and churn run through everything below.
	stopReaders := readSnapshotsWhileChurning(t, p, f)

	send := func(n int) {
		t.Helper()
		for range n {
			for _, cs := range []kubernetes.Interface{fileCS, proxyCS} {
				if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	send(5)
	// A pair that does not match is rejected, then carol's taken.
	dir.write(t, &testserver.KeyPair{CertPEM: f.alice.CertPEM, KeyPEM: f.bob.KeyPEM}, f.ca.CertPEM())
	waitFor(t, "the mismatched pair rejected", func() bool {
		i, _ := findIdentity(p.Identities(), isFile)
		return i.RotationErrors == 1
	})
	dir.write(t, f.carol, f.ca.CertPEM())
	waitFor(t, "carol's certificate taken", func() bool {
		i, _ := findIdentity(p.Identities(), isFile)
		return i.Rotations == 1
	})
	send(5)
	stopReaders()
	waitFor(t, "every connection closed", func() bool {
		for _, i := range p.Identities() {
			if i.OpenConns != 0 {
				return false
			}
		}
		return true
	})

	checkSnapshot(t, p, server, f, dir, proxy.Addr(), isFile, isProxy)
}

// readSnapshotsWhileChurning reads p's snapshot on two goroutines, checking
// its order, while a third wraps new identities; the returned func stops
// them and waits.
func readSnapshotsWhileChurning(t *testing.T, p *Pool, f *fixture) func() {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(3)
	for range 2 {
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				infos := p.Identities()
				if !slices.IsSortedFunc(infos, func(a, b IdentityInfo) int { return strings.Compare(a.Name, b.Name) }) {
					t.Errorf("snapshot not sorted by name")
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			cfg := churnConfig(f, i)
			if err := p.Wrap(cfg); err != nil {
				t.Error(err)
				return
			}
			if _, err := rest.HTTPClientFor(cfg); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	return func() {
		close(stop)
		wg.Wait()
	}
}

// checkSnapshot checks TestIdentitySnapshot's snapshot, once every
// connection is closed, against what the server counted.
func checkSnapshot(t *testing.T, p *Pool, server *serverConns, f *fixture, dir *certDir, proxyAddr string, isFile, isProxy func(IdentityInfo) bool) {
	t.Helper()
	infos := p.Identities()
	t.Logf("%d identities", len(infos))
	file, ok := findIdentity(infos, isFile)
	if !ok {
		t.Fatal("no identity with files in the snapshot")
	}
	prox, ok := findIdentity(infos, isProxy)
	if !ok {
		t.Fatal("no identity with the proxy in the snapshot")
	}
	for _, c := range []struct {
		name string
		info IdentityInfo
		cns  []string
	}{{"certificate files", file, []string{"alice", "carol"}}, {"proxy", prox, []string{"bob"}}} {
		conns, full, resumed := server.count(c.cns...)
		if c.info.Dials != conns || c.info.Handshakes != full || c.info.Resumptions != resumed {
			t.Errorf("%s: snapshot counts %d dials, %d full and %d resumed handshakes; the server saw %d connections, %d full and %d resumed",
				c.name, c.info.Dials, c.info.Handshakes, c.info.Resumptions, conns, full, resumed)
		}
		if conns != 10 {
			t.Errorf("%s: the server saw %d connections, want 10 (one per request)", c.name, conns)
		}
		if !slices.Equal(c.info.Hosts, []string{f.srv.URL()}) {
			t.Errorf("%s: hosts %q, want %q", c.name, c.info.Hosts, f.srv.URL())
		}
		if c.info.Auth != "client certificate" {
			t.Errorf("%s: auth %q", c.name, c.info.Auth)
		}
	}
	if prox.Proxy != "http://"+proxyAddr {
		t.Errorf("proxy shown as %q, want its user info dropped", prox.Proxy)
	}
	if file.CertSubject != "carol" || file.Rotations != 1 || file.RotationErrors != 1 {
		t.Errorf("file identity: subject %q, %d rotations, %d errors; want carol, 1, 1", file.CertSubject, file.Rotations, file.RotationErrors)
	}
	if file.LastErrorFile != dir.cert || !strings.Contains(file.LastError, "do not form a valid pair") || file.LastErrorTime.After(file.Since) {
		t.Errorf("last error %q in %q at %v (material since %v): want the pair rejected, before the rotation", file.LastError, file.LastErrorFile, file.LastErrorTime, file.Since)
	}
	if !slices.Equal(file.Files, []string{dir.ca, dir.cert, dir.key}) {
		t.Errorf("file identity: files %q", file.Files)
	}
	if prox.Files != nil || prox.CertSubject != "bob" {
		t.Errorf("proxy identity: files %q, subject %q", prox.Files, prox.CertSubject)
	}
	var dials, hs, res uint64
	for _, i := range infos {
		dials, hs, res = dials+i.Dials, hs+i.Handshakes, res+i.Resumptions
	}
	if st := p.Stats(); st.Dials != dials || st.Handshakes != hs || st.Resumptions != res {
		t.Errorf("pool counts %d dials, %d and %d handshakes; its identities %d, %d and %d", st.Dials, st.Handshakes, st.Resumptions, dials, hs, res)
	}
}

// TestIdentitiesShowExpiry: the snapshot shows the expiry of each
// identity's client certificate, and after a rotation the new one's.
func TestIdentitiesShowExpiry(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	now := time.Now()
	short, err := f.ca.Issue(testserver.CertSpec{CommonName: "short", Client: true, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(90 * time.Minute)})
	must(t, err)
	p := newPool(t, WithPollInterval(0), withDebounce(10*time.Millisecond))
	shortDir := newCertDir(t, renameOver, short, f.ca.CertPEM())
	longDir := newCertDir(t, renameOver, f.alice, f.ca.CertPEM()) // valid for 24 hours
	shortCfg, _ := shortDir.wrapped(t, p, f.srv.URL())
	longCfg, _ := longDir.wrapped(t, p, f.srv.URL())
	notAfter := func(dir *certDir) time.Time {
		i, ok := findIdentity(p.Identities(), func(i IdentityInfo) bool { return slices.Contains(i.Files, dir.cert) })
		if !ok {
			t.Fatalf("no identity for %s", dir.cert)
		}
		return i.CertNotAfter
	}
	for dir, kp := range map[*certDir]*testserver.KeyPair{shortDir: short, longDir: f.alice} {
		if got := notAfter(dir); !got.Equal(kp.Cert.NotAfter) {
			t.Errorf("%s: NotAfter %v, want %v", dir.cert, got, kp.Cert.NotAfter)
		}
	}
	longDir.write(t, short, f.ca.CertPEM())
	waitFor(t, "the rotation shown", func() bool { return notAfter(longDir).Equal(short.Cert.NotAfter) })
	runtime.KeepAlive([]*rest.Config{shortCfg, longCfg})
}

// TestIdentityHosts: a TLSTransport round tripper serves any server its
// roots trust; requests to two servers in turn list both among the
// identity's hosts, and a request to the server recorded last allocates
// nothing for it.
func TestIdentityHosts(t *testing.T) {
	f := newFixture(t, testserver.Options{ClientAuth: testserver.VerifyClientCertIfGiven})
	other, err := testserver.Start(testserver.Options{CA: f.ca, ClientAuth: testserver.VerifyClientCertIfGiven})
	must(t, err)
	defer other.Close()
	p := newPool(t)
	rt, err := p.TLSTransport(TLSTransportConfig{TLS: &tls.Config{RootCAs: f.ca.Pool()}})
	must(t, err)
	for _, server := range []string{f.srv.URL(), other.URL(), f.srv.URL(), other.URL()} {
		req, err := http.NewRequest(http.MethodGet, server+"/version", nil)
		must(t, err)
		resp, err := rt.RoundTrip(req)
		must(t, err)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	infos := p.Identities()
	want := []string{f.srv.URL(), other.URL()}
	slices.Sort(want)
	if len(infos) != 1 || !slices.Equal(infos[0].Hosts, want) {
		t.Fatalf("identities %+v, want one with hosts %q", infos, want)
	}

	e := &entry{}
	u, err := url.Parse(f.srv.URL() + "/version")
	must(t, err)
	e.sentTo(u)
	if n := testing.AllocsPerRun(100, func() { e.sentTo(u) }); n != 0 {
		t.Errorf("a request to the server recorded last: %v allocations, want 0", n)
	}
}
