package sharedtransport

// The seed's own scenario (Karmada issue 5574, PR 5615): an aggregated
// apiserver proxies requests to member clusters and builds each member's
// config from its Secret for every request. The open questions of PR 5615 get
// an answer each: Secret rotation, a deleted cluster, a cluster that goes
// offline and comes back, exec-style upgrades. Connections are counted by
// the member servers.

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/childproc"
	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/spdyecho"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// newFront serves f, the aggregated apiserver under test, and returns a
// client for it.
func newFront(t testing.TB, f *memberproxy.Front) *memberproxy.Client {
	t.Helper()
	c := memberproxy.Serve(f)
	t.Cleanup(c.Close)
	return c
}

func certCluster(name string, f *fixture, kp *testserver.KeyPair) memberproxy.Cluster {
	return memberproxy.Cluster{Name: name, APIEndpoint: f.srv.URL(), Secret: memberproxy.Secret{
		CAData: f.ca.CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM,
	}}
}

func tokenCluster(name string, f *fixture, token string) memberproxy.Cluster {
	return memberproxy.Cluster{Name: name, APIEndpoint: f.srv.URL(), Secret: memberproxy.Secret{
		CAData: f.ca.CertPEM(), Token: token,
	}}
}

// resetMember closes the member's connections and zeroes its counters.
func resetMember(t testing.TB, f *fixture) {
	t.Helper()
	f.srv.CloseClientConnections()
	waitFor(t, "member connections closed", func() bool { return f.srv.OpenConns() == 0 })
	f.srv.ResetStats()
}

// TestProxySeedLoad: 100 clients x 20 requests through the front, spread
// over three members (client certificate, token, and a client certificate
// through an HTTP proxy). Once a first request to each member opened its
// connection, the pool's requests ride it, one connection per member, as
// those of client-go's best case do (one transport per member built once,
// the control); with a new transport per request, one per request.
func TestProxySeedLoad(t *testing.T) {
	clients, requests := 100, 20
	if raceDetector() {
		requests = 2
	}
	certMember := newFixture(t, testserver.Options{})
	tokenMember := newFixture(t, testserver.Options{
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{"front-token": "karmada-front"},
	})
	proxiedMember := newFixture(t, testserver.Options{})
	httpProxy := newConnectProxy(t)

	clusters := memberproxy.NewClusters()
	proxied := certCluster("member-3", proxiedMember, proxiedMember.alice)
	proxied.ProxyURL = httpProxy.URL()
	for _, cl := range []memberproxy.Cluster{
		certCluster("member-1", certMember, certMember.alice),
		tokenCluster("member-2", tokenMember, "front-token"),
		proxied,
	} {
		clusters.Set(cl)
	}
	members := []*fixture{certMember, tokenMember, proxiedMember}
	names := []string{"member-1", "member-2", "member-3"}
	perMember := make([]int, len(members))
	for n := range clients * requests {
		perMember[n%len(members)]++
	}
	// load sends the requests through a front in mode, and returns the
	// connections the members accepted; Go's HTTP proxy's tunnels are
	// member-3's.
	load := func(t *testing.T, name string, f *memberproxy.Front, warm bool) (accepted []uint64, errs []error) {
		for _, m := range members {
			resetMember(t, m)
		}
		httpProxy.ResetStats()
		defer httpProxy.CloseTunnels()
		fr := newFront(t, f)
		ctx := context.Background()
		for _, name := range names {
			if warm {
				must(t, fr.ListNodes(ctx, name, ""))
			}
		}
		start := time.Now()
		errs = runClients(clients, requests, func(c, i int) error {
			return fr.ListNodes(ctx, names[(c*requests+i)%len(names)], "")
		})
		elapsed := time.Since(start)
		var line []string
		for m, member := range members {
			st := member.srv.Stats()
			accepted = append(accepted, st.Accepted)
			line = append(line, fmt.Sprintf("%s %d requests, %d connections, %d full handshakes", names[m], perMember[m], st.Accepted, st.FullHandshakes))
		}
		t.Logf("%s: %d requests in %v: %s; HTTP proxy tunnels %d", name, clients*requests, elapsed.Round(time.Millisecond), strings.Join(line, "; "), httpProxy.Stats().Tunnels)
		return accepted, errs
	}

	var control []uint64
	for _, mode := range []string{"client-go's best case", "pool"} {
		t.Run(mode, func(t *testing.T) {
			f := &memberproxy.Front{Clusters: clusters, Mode: memberproxy.TransportFor, TransportFor: clientGoBestCase()}
			var p *Pool
			if mode == "pool" {
				p = newPool(t)
				f.TransportFor = declaredFor(p)
			}
			accepted, errs := load(t, mode, f, true)
			checkNoErrors(t, errs)
			if p == nil {
				control = accepted
				return
			}
			if st := p.Stats(); st.Identities != 3 || st.Misses != 3 {
				t.Errorf("pool %+v, want 3 identities built once each", st)
			}
			for m := range members {
				if accepted[m] > max(control[m], 1) {
					t.Errorf("%s accepted %d connections, with client-go's best case %d", names[m], accepted[m], control[m])
				}
			}
		})
	}

	t.Run("new transport per request (Karmada before PR 5610)", func(t *testing.T) {
		accepted, errs := load(t, "new transport per request", &memberproxy.Front{Clusters: clusters, Mode: memberproxy.NewTransport}, false)
		if len(errs) > 0 {
			// A connection and a full handshake per request are the
			// baseline's cost; on a loaded machine a few of them fail too
			// ("unexpected EOF"). They are counted, not the subject.
			t.Logf("%d of %d requests failed, first: %v", len(errs), clients*requests, errs[0])
		}
		for m := range members {
			if accepted[m] != uint64(perMember[m]) {
				t.Errorf("%s accepted %d connections for %d requests, want one per request", names[m], accepted[m], perMember[m])
			}
		}
	})
}

// clientGoBestCase is a front's TransportFor as client-go's best case:
// one transport per member and credentials, built by rest.TransportFor for
// the first config and used for every request after.
func clientGoBestCase() func(*rest.Config, http.Header) (http.RoundTripper, error) {
	var mu sync.Mutex
	built := map[string]http.RoundTripper{}
	return func(cfg *rest.Config, _ http.Header) (http.RoundTripper, error) {
		mu.Lock()
		defer mu.Unlock()
		key := cfg.Host + "\x00" + cfg.BearerToken + "\x00" + string(cfg.CertData)
		if rt, ok := built[key]; ok {
			return rt, nil
		}
		rt, err := rest.TransportFor(cfg)
		if err == nil {
			built[key] = rt
		}
		return rt, err
	}
}

// newRotationMember starts a member that takes the front's old and new
// credentials and checks which ones requests after the rotation use.
func newRotationMember(t *testing.T) *testserver.RotationMember {
	t.Helper()
	m, err := testserver.StartRotationMember()
	must(t, err)
	t.Cleanup(func() { m.Close() })
	return m
}

// TestProxySecretRotation replaces the front's credentials in the member's
// Secret halfway through the seed's load.
func TestProxySecretRotation(t *testing.T) {
	clients, requests := 100, 20
	if raceDetector() {
		requests = 4
	}
	for _, tc := range []struct {
		name        string
		secret      func(m *testserver.RotationMember, version int) memberproxy.Secret
		newIdentity bool // the change makes a new TLS identity
	}{
		{"client certificate", func(m *testserver.RotationMember, v int) memberproxy.Secret {
			kp := map[int]*testserver.KeyPair{1: m.V1, 2: m.V2}[v]
			return memberproxy.Secret{CAData: m.CA().CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM}
		}, true},
		{"token", func(m *testserver.RotationMember, v int) memberproxy.Secret {
			return memberproxy.Secret{CAData: m.CA().CertPEM(), Token: fmt.Sprintf("token-v%d", v)}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newRotationMember(t)
			p := newPool(t, WithIdleTimeout(100*time.Millisecond))
			clusters := memberproxy.NewClusters()
			cluster := memberproxy.Cluster{Name: "member-1", APIEndpoint: m.URL(), Secret: tc.secret(m, 1)}
			clusters.Set(cluster)
			fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: declaredFor(p)})

			var done atomic.Int64
			var rotated atomic.Bool
			half := make(chan struct{})
			rotation := make(chan Stats, 1)
			go func() {
				<-half
				before := p.Stats()
				cluster.Secret = tc.secret(m, 2)
				clusters.Set(cluster)
				rotated.Store(true)
				rotation <- before
			}()
			ctx := context.Background()
			errs := runClients(clients, requests, func(c, i int) error {
				ua := ""
				if rotated.Load() {
					ua = testserver.AfterRotation
				}
				err := fr.ListNodes(ctx, "member-1", ua)
				if done.Add(1) == int64(clients*requests/2) {
					close(half)
				}
				return err
			})
			checkNoErrors(t, errs)
			before := <-rotation

			// A client that keeps the new config, so that only the old
			// identity has nothing referring to it.
			current, err := memberproxy.RestConfig(cluster)
			must(t, err)
			must(t, p.Wrap(current))
			afterLoad := p.Stats()
			waitFor(t, "old identity released", func() bool {
				runtime.GC()
				return p.Stats().Identities == 1
			})
			// The old identity leaves the pool's count just before its
			// connections are closed, and the pool's open connections
			// count them until then: the pool and the member agree, and
			// every connection the pool counts is the remaining identity's.
			waitFor(t, "old identity's connections closed", func() bool {
				open := p.Stats().OpenConns
				return m.OpenConns() == open && identityConns(p) == open
			})
			checkProxyRotation(t, tc.name, tc.newIdentity, m, before, afterLoad, clients*requests)
			runtime.KeepAlive(current)
		})
	}
}

// identityConns is the sum of the open connections of p's identities.
func identityConns(p *Pool) int {
	n := 0
	for _, i := range p.Identities() {
		n += i.OpenConns
	}
	return n
}

// checkProxyRotation checks what member m saw of TestProxySecretRotation's
// total requests, rotated halfway, and what the pool built: before the
// rotation, after the load.
func checkProxyRotation(t *testing.T, name string, newIdentity bool, m *testserver.RotationMember, before, afterLoad Stats, total int) {
	t.Helper()
	st := m.Stats()
	users, after, violations := m.Seen()
	t.Logf("%s rotated after %d of %d requests: member saw %v, %d requests sent after the rotation; "+
		"identities %d before, %d after the load, 1 after GC; member accepted %d connections, %d open now",
		name, total/2, total, users, after,
		before.Identities, afterLoad.Identities, st.Accepted, st.Open)
	if len(violations) > 0 {
		t.Errorf("%d requests sent after the rotation used the old credentials: %v", len(violations), violations[:min(5, len(violations))])
	}
	if after == 0 || users["front-v1"] == 0 || users["front-v2"] == 0 {
		t.Errorf("the load did not straddle the rotation: %v, %d after", users, after)
	}
	if newIdentity {
		// The old identity may be gone already: nothing refers to it
		// once the requests that used it are done.
		if afterLoad.Misses != 2 || afterLoad.Identities > 2 {
			t.Errorf("after a certificate change: %+v, want 2 identities built", afterLoad)
		}
	} else if afterLoad.Misses != 1 {
		// A token is not part of the identity: the transport stays.
		t.Errorf("a token change built a transport: %+v", afterLoad)
	}
	if st.Open == 0 {
		t.Errorf("member has no connection open, want the new identity's")
	}
}

// TestProxyClusterDeleted: a deleted cluster's identity and connections are
// released once nothing refers to them; a watch still running keeps them.
func TestProxyClusterDeleted(t *testing.T) {
	gone, stays := newFixture(t, testserver.Options{}), newFixture(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(50*time.Millisecond))
	clusters := memberproxy.NewClusters()
	clusters.Set(certCluster("member-1", gone, gone.alice))
	staying := certCluster("member-2", stays, stays.alice)
	clusters.Set(staying)
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: declaredFor(p)})
	ctx := context.Background()

	// member-2 has a long-lived client, as a controller would.
	held, err := memberproxy.RestConfig(staying)
	must(t, err)
	must(t, p.Wrap(held))
	checkNoErrors(t, runClients(10, 10, func(c, i int) error {
		return fr.ListNodes(ctx, []string{"member-1", "member-2"}[(c+i)%2], "")
	}))

	// A watch through the front on member-1, running while it is deleted.
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	req, err := http.NewRequestWithContext(watchCtx, http.MethodGet, fr.ClusterURL("member-1", "/api/v1/nodes?watch=true"), nil)
	must(t, err)
	resp, err := fr.HTTP.Do(req)
	must(t, err)
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, `"ADDED"`) {
		t.Fatalf("watch through the front: %q, %v", line, err)
	}

	staysAccepted := stays.srv.Stats().Accepted
	clusters.Delete("member-1")
	code, body, err := fr.Get(ctx, "member-1", "/api/v1/nodes", "")
	if err != nil || code != http.StatusNotFound || !strings.Contains(string(body), `\"member-1\" not found`) {
		t.Errorf("request to the deleted cluster: %d %s %v, want 404 naming it", code, body, err)
	}
	for range 5 {
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
	if got := p.Stats().Identities; got != 2 {
		t.Errorf("while a watch runs on the deleted cluster: %d identities, want 2", got)
	}
	if gone.srv.OpenConns() == 0 {
		t.Error("the running watch lost its connection")
	}

	stopWatch()
	resp.Body.Close()
	waitFor(t, "deleted cluster's identity released", func() bool {
		runtime.GC()
		return p.Stats().Identities == 1
	})
	waitFor(t, "deleted cluster's connections closed", func() bool { return gone.srv.OpenConns() == 0 })
	if err := fr.ListNodes(ctx, "member-2", ""); err != nil {
		t.Errorf("the other member: %v", err)
	}
	if st := stays.srv.Stats(); st.Accepted != staysAccepted || st.Open == 0 {
		t.Errorf("the other member: %d connections accepted, %d before the deletion, %d open; want no new one, and its own open", st.Accepted, staysAccepted, st.Open)
	}
	t.Logf("deleted cluster released: pool %+v; its member has %d connections open", p.Stats(), gone.srv.OpenConns())
	runtime.KeepAlive(held)
}

// TestProxyClusterOffline: the member stops for 10 s and restarts on the same
// port. Requests fail fast with a clear error while it is down, and succeed as
// soon as it is back.
func TestProxyClusterOffline(t *testing.T) {
	const down, staleWindow = 10 * time.Second, time.Second
	member, other := newFixture(t, testserver.Options{}), newFixture(t, testserver.Options{})
	p := newPool(t)
	clusters := memberproxy.NewClusters()
	clusters.Set(certCluster("member-1", member, member.alice))
	clusters.Set(certCluster("member-2", other, other.alice))
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: declaredFor(p)})
	ctx := context.Background()
	checkNoErrors(t, runClients(10, 10, func(int, int) error { return fr.ListNodes(ctx, "member-1", "") }))

	must(t, member.srv.Stop())
	stopped := time.Now()
	var (
		wg         sync.WaitGroup
		mu         sync.Mutex
		failed     int
		slowest    time.Duration
		unexpected []string
	)
	for c := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(stopped) < down {
				start := time.Now()
				code, body, err := fr.Get(ctx, "member-1", "/api/v1/nodes", "")
				took := time.Since(start)
				var otherErr error
				if c == 0 {
					otherErr = fr.ListNodes(ctx, "member-2", "") // the other member is unaffected
				}
				mu.Lock()
				failed++
				slowest = max(slowest, took)
				// A request sent just after the stop may still meet the
				// connection the stop cut (a broken pipe, a connection
				// closed under it), as it would through client-go alone;
				// after that the member refuses the dial.
				refused := strings.Contains(string(body), "connection refused") || start.Sub(stopped) < staleWindow
				if err != nil || code != http.StatusServiceUnavailable ||
					!strings.Contains(string(body), `cluster \"member-1\" is unreachable`) || !refused {
					unexpected = append(unexpected, fmt.Sprintf("%d %s %v", code, body, err))
				}
				if otherErr != nil {
					unexpected = append(unexpected, otherErr.Error())
				}
				mu.Unlock()
				time.Sleep(50 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	for _, u := range unexpected[:min(5, len(unexpected))] {
		t.Errorf("while the member was down: %s", u)
	}
	if slowest > 5*time.Second {
		t.Errorf("a request to the offline member took %v, want a fast failure", slowest)
	}

	must(t, member.srv.Restart())
	member.srv.ResetStats()
	if err := fr.ListNodes(ctx, "member-1", ""); err != nil {
		t.Errorf("first request after the member came back: %v", err)
	}
	checkNoErrors(t, runClients(100, 5, func(int, int) error { return fr.ListNodes(ctx, "member-1", "") }))
	st := member.srv.Stats()
	if st.Accepted > 2 {
		t.Errorf("after the restart the member accepted %d connections, want at most 2", st.Accepted)
	}
	t.Logf("member down %v: %d requests failed with 503, slowest %v; back: first request succeeded, %d connections for 501 requests; pool %+v",
		down, failed, slowest.Round(time.Millisecond), st.Accepted, p.Stats())
}

// newEchoMember starts a SPDY echo member that accepts its CA's client
// certificates and tokens.
func newEchoMember(t *testing.T, tokens map[string]string) *spdyecho.Member {
	t.Helper()
	m, err := spdyecho.Start(tokens)
	must(t, err)
	t.Cleanup(m.Close)
	return m
}

// TestProxyUpgrade: an exec-style SPDY upgrade through the front reaches the
// member on a connection of its own, authenticated as the front, and echoes
// data both ways; the pool's connections never carry it.
func TestProxyUpgrade(t *testing.T) {
	member := newEchoMember(t, map[string]string{"exec-token": "front-by-token"})
	front1, err := member.CA.IssueClient("front-by-cert")
	must(t, err)
	httpProxy := newConnectProxy(t)
	secret := memberproxy.Secret{CAData: member.CA.CertPEM(), CertData: front1.CertPEM, KeyData: front1.KeyPEM}
	clusters := memberproxy.NewClusters()
	clusters.Set(memberproxy.Cluster{Name: "by-cert", APIEndpoint: member.URL, Secret: secret})
	clusters.Set(memberproxy.Cluster{Name: "by-token", APIEndpoint: member.URL, Secret: memberproxy.Secret{CAData: member.CA.CertPEM(), Token: "exec-token"}})
	clusters.Set(memberproxy.Cluster{Name: "by-proxy", APIEndpoint: member.URL, ProxyURL: httpProxy.URL(), Secret: secret})
	p := newPool(t)
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: declaredFor(p)})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	for _, tc := range []struct{ cluster, user string }{
		{"by-cert", "front-by-cert"}, {"by-token", "front-by-token"}, {"by-proxy", "front-by-cert"},
	} {
		t.Run(tc.cluster, func(t *testing.T) {
			for range 5 {
				code, body, err := fr.Get(ctx, tc.cluster, "/version", "")
				if err != nil || code != http.StatusOK || string(body) != "hello "+tc.user {
					t.Fatalf("plain request: %d %q %v", code, body, err)
				}
			}
			accepted, tunnels, pool := member.Accepted(), httpProxy.Stats().Tunnels, p.Stats()

			payload := "echo me, " + tc.cluster
			got, err := spdyecho.Exec(ctx, fr.ClusterURL(tc.cluster, "/api/v1/namespaces/default/pods/echo/exec?command=cat&stdin=true&stdout=true"),
				memberproxy.CallerAuthorization, payload)
			must(t, err)
			if want := "hello " + tc.user + "\n" + payload; got != want {
				t.Errorf("exec through the front: %q, want %q", got, want)
			}
			if last := member.LastUpgrade(); last != tc.user+" HTTP/1.1" {
				t.Errorf("member saw the upgrade as %q, want %q", last, tc.user+" HTTP/1.1")
			}
			if n := member.Accepted() - accepted; n != 1 {
				t.Errorf("the upgrade made the member accept %d connections, want 1 of its own", n)
			}
			after := p.Stats()
			if after.Dials != pool.Dials || after.Handshakes != pool.Handshakes {
				t.Errorf("the upgrade went through the pool: dials %d -> %d, handshakes %d -> %d", pool.Dials, after.Dials, pool.Handshakes, after.Handshakes)
			}
			if tc.cluster == "by-proxy" {
				if n := httpProxy.Stats().Tunnels - tunnels; n != 1 {
					t.Errorf("the upgrade opened %d tunnels through the HTTP proxy, want 1", n)
				}
			}
			waitFor(t, "upgrade connection closed", func() bool { return member.Open() == int64(pool.OpenConns) })
			t.Logf("%s: exec echoed %q; member accepted %d connections in all; pool %+v", tc.cluster, payload, member.Accepted(), after)
		})
	}
}

// TestProxyManyIdentities: 200 member identities (distinct client
// certificates, one member server) behind the front make exactly one
// connection each, and take at most 64 KiB of the front's heap each, 16 KiB
// of it for the pool's transport. The member runs in a child process, so the
// heap measured here is the front's alone.
func TestProxyManyIdentities(t *testing.T) {
	const identities = 200
	member := startMemberProcess(t)
	clusters := memberproxy.NewClusters()
	for i := range identities {
		kp, err := member.CA.IssueClient(fmt.Sprintf("front-%03d", i))
		must(t, err)
		clusters.Set(memberproxy.Cluster{Name: fmt.Sprintf("member-%03d", i), APIEndpoint: member.URL, Secret: memberproxy.Secret{
			CAData: member.CA.CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM,
		}})
	}
	p := newPool(t, WithIdleTimeout(50*time.Millisecond))
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: declaredFor(p)})
	ctx := context.Background()
	// Warm the front (its client connections, the proxy code) on a cluster
	// of its own before measuring.
	warm, _ := clusters.Get("member-000")
	warm.Name = "warm-up"
	clusters.Set(warm)
	checkNoErrors(t, runClients(50, 2, func(int, int) error { return fr.ListNodes(ctx, "warm-up", "") }))
	clusters.Delete("warm-up")
	waitFor(t, "warm-up identity released", func() bool { runtime.GC(); return p.Stats().Identities == 0 })
	waitFor(t, "warm-up connection closed", func() bool { return memberStats(t, member).Open == 0 })
	must(t, member.ResetStats(ctx))

	// The test's own connections to the front live in this process too:
	// closed before every measurement.
	before := memStats(fr)
	// Every member is held by a client, as a controller would, so that the
	// identities stay while they are measured.
	held := make([]*rest.Config, identities)
	for i := range identities {
		cl, _ := clusters.Get(fmt.Sprintf("member-%03d", i))
		cfg, err := memberproxy.RestConfig(cl)
		must(t, err)
		must(t, p.Wrap(cfg))
		held[i] = cfg
	}
	wrapped := memStats(fr)
	// One request per identity, all at once: each dials a connection of
	// its own, as net/http dials one per request waiting.
	checkNoErrors(t, runClients(identities, 1, func(c, _ int) error {
		return fr.ListNodes(ctx, fmt.Sprintf("member-%03d", c%identities), "")
	}))
	st := memberStats(t, member)
	if st.Accepted != identities {
		t.Errorf("%d identities: member accepted %d connections, want exactly one each", identities, st.Accepted)
	}
	if got := p.Stats(); got.Identities != identities || got.OpenConns != identities {
		t.Errorf("pool %+v, want %d identities with one connection each", got, identities)
	}
	live := memStats(fr)

	runtime.KeepAlive(held)
	held = nil
	waitFor(t, "identities released", func() bool { runtime.GC(); return p.Stats().Identities == 0 })
	waitFor(t, "connections closed", func() bool { return memberStats(t, member).Open == 0 })

	perID := func(a, b uint64) int64 { return (int64(a) - int64(b)) / identities }
	t.Logf("%d identities, one connection each (member accepted %d), per identity: heap %d bytes "+
		"(%d for the pool's transport, %d for the connection and what the requests left), "+
		"%d goroutine and %d bytes of stack; all released once unreferenced",
		identities, st.Accepted, perID(live.heap, before.heap), perID(wrapped.heap, before.heap),
		perID(live.heap, wrapped.heap), (live.goroutines-wrapped.goroutines)/identities, perID(live.stack, wrapped.stack))
	// Wrap of a config client-go caches also asks client-go's cache for its
	// transport (which any client of the config builds anyway): about 8 KB
	// of the figure. Room is left for the collector's timing.
	if got := perID(live.heap, before.heap); got > 64<<10 {
		t.Errorf("heap grew %d bytes per identity, want at most 64 KiB", got)
	}
	if got := perID(wrapped.heap, before.heap); got > 24<<10 {
		t.Errorf("Wrap took %d bytes of heap per identity, want at most 24 KiB", got)
	}
}

type memSnapshot struct {
	heap, stack uint64
	goroutines  int
}

// memStats measures the heap once fr's client connections are closed and
// the goroutines have settled.
func memStats(fr *memberproxy.Client) memSnapshot {
	fr.HTTP.CloseIdleConnections()
	n, stable := runtime.NumGoroutine(), 0
	for stable < 5 {
		time.Sleep(20 * time.Millisecond)
		if m := runtime.NumGoroutine(); m == n {
			stable++
		} else {
			n, stable = m, 0
		}
	}
	var ms runtime.MemStats
	for range 3 {
		runtime.GC()
	}
	runtime.ReadMemStats(&ms)
	return memSnapshot{heap: ms.HeapAlloc, stack: ms.StackInuse, goroutines: runtime.NumGoroutine()}
}

// memberProcessEnv names the child's role when this test binary runs as
// TestProxyManyIdentities's member server.
const memberProcessEnv = "SHAREDTRANSPORT_MEMBER_PROCESS"

// startMemberProcess runs a testserver in a child process of this test
// binary (served from TestMain), so that its heap is not the front's.
func startMemberProcess(t *testing.T) *testserver.Process {
	t.Helper()
	m, err := testserver.StartProcess(context.Background(), "member", childproc.Options{
		Env:    memberProcessEnv,
		Args:   []string{"-test.run=^$", "-test.count=1"},
		Stderr: os.Stderr,
	})
	must(t, err)
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("member process: %v", err)
		}
	})
	return m
}

func memberStats(t testing.TB, m *testserver.Process) testserver.Stats {
	t.Helper()
	st, err := m.Stats(context.Background())
	must(t, err)
	return st
}

// declaredFor is the member front's TransportFor on p, with each member's
// ProxyHeader wrapper declared.
func declaredFor(p *Pool) func(*rest.Config, http.Header) (http.RoundTripper, error) {
	return func(cfg *rest.Config, h http.Header) (http.RoundTripper, error) {
		return p.TransportFor(cfg, WithProxyConnectHeader(h))
	}
}
