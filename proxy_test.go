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
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/util/httpstream/spdy"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// front is the aggregated apiserver under test, and an HTTP client for it.
type front struct {
	url    string
	client *http.Client
}

func newFront(t testing.TB, f *memberproxy.Front) *front {
	t.Helper()
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	tr := &http.Transport{MaxIdleConnsPerHost: 200}
	t.Cleanup(tr.CloseIdleConnections)
	return &front{url: srv.URL, client: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

func (fr *front) clusterURL(cluster, path string) string {
	return fr.url + memberproxy.PathPrefix + cluster + "/proxy" + path
}

// get sends GET path to cluster through the front.
func (fr *front) get(ctx context.Context, cluster, path, userAgent string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fr.clusterURL(cluster, path), nil)
	if err != nil {
		return 0, nil, err
	}
	if userAgent != "" {
		req.Header.Set("User-Agent", userAgent)
	}
	// A caller's own credentials must never reach the member.
	req.Header.Set("Authorization", "Bearer caller-token-for-the-front")
	resp, err := fr.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// listNodes lists nodes on cluster through the front and fails on anything
// but a NodeList.
func (fr *front) listNodes(ctx context.Context, cluster, userAgent string) error {
	code, body, err := fr.get(ctx, cluster, "/api/v1/nodes", userAgent)
	if err != nil {
		return fmt.Errorf("%s: %w", cluster, err)
	}
	if code != http.StatusOK || !strings.Contains(string(body), `"NodeList"`) {
		return fmt.Errorf("%s: %d %s", cluster, code, body)
	}
	return nil
}

// raceDetector reports whether the test binary was built with -race. The
// race detector slows TLS handshakes about tenfold, so the load tests send
// fewer requests under it; every path is still raced.
func raceDetector() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
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
// through an HTTP proxy). With the pool each member accepts at most two
// connections; with a new transport per request, one per request.
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

	for _, tc := range []struct {
		name  string
		pool  bool
		mode  memberproxy.Mode
		check func(t *testing.T, member int, accepted uint64)
	}{
		{"with the pool", true, memberproxy.TransportFor, func(t *testing.T, m int, accepted uint64) {
			if accepted > 2 {
				t.Errorf("%s accepted %d connections, want at most 2", names[m], accepted)
			}
		}},
		{"new transport per request (Karmada before PR 5610)", false, memberproxy.NewTransport, func(t *testing.T, m int, accepted uint64) {
			if accepted != uint64(perMember[m]) {
				t.Errorf("%s accepted %d connections for %d requests, want one per request", names[m], accepted, perMember[m])
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, m := range members {
				resetMember(t, m)
			}
			httpProxy.ResetStats()
			f := &memberproxy.Front{Clusters: clusters, Mode: tc.mode}
			var p *Pool
			if tc.pool {
				p = newPool(t)
				f.TransportFor = p.TransportFor
			}
			fr := newFront(t, f)
			ctx := context.Background()
			start := time.Now()
			errs := runClients(clients, requests, func(c, i int) error {
				return fr.listNodes(ctx, names[(c*requests+i)%len(names)], "")
			})
			elapsed := time.Since(start)
			if tc.pool {
				checkNoErrors(t, errs)
			} else if len(errs) > 0 {
				// A connection and a full handshake per request are the
				// baseline's cost; on a loaded machine a few of them fail
				// too ("unexpected EOF"). They are counted, not the subject.
				t.Logf("%s: %d of %d requests failed, first: %v", tc.name, len(errs), clients*requests, errs[0])
			}
			var line []string
			for m, member := range members {
				st := member.srv.Stats()
				line = append(line, fmt.Sprintf("%s %d requests, %d connections, %d full handshakes", names[m], perMember[m], st.Accepted, st.FullHandshakes))
				tc.check(t, m, st.Accepted)
			}
			t.Logf("%s: %d requests in %v: %s; HTTP proxy tunnels %d", tc.name, clients*requests, elapsed.Round(time.Millisecond), strings.Join(line, "; "), httpProxy.Stats().Tunnels)
			if tc.pool {
				if st := p.Stats(); st.Identities != 3 || st.Misses != 3 {
					t.Errorf("pool %+v, want 3 identities built once each", st)
				}
				if n := httpProxy.Stats().Tunnels; n > 2 {
					t.Errorf("HTTP proxy opened %d tunnels with the pool, want at most 2", n)
				}
			} else if n := httpProxy.Stats().Tunnels; n != uint64(perMember[2]) {
				t.Errorf("HTTP proxy opened %d tunnels for %d requests, want one per request", n, perMember[2])
			}
			for _, m := range members {
				resetMember(t, m)
			}
			httpProxy.CloseTunnels()
		})
	}
}

// rotationMember is a member that accepts the front's old and new
// credentials (client certificates front-v1 and front-v2, tokens token-v1 and
// token-v2) and checks that requests sent after the Secret changed use the
// new ones.
type rotationMember struct {
	*fixture
	v1, v2 *testserver.KeyPair

	mu         sync.Mutex // guards the fields below
	users      map[string]int
	after      int      // requests sent after the rotation
	violations []string // requests sent after the rotation with old credentials
}

const afterRotation = "sent-after-rotation"

func newRotationMember(t *testing.T) *rotationMember {
	m := &rotationMember{users: map[string]int{}}
	m.fixture = newFixture(t, testserver.Options{
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{"token-v1": "front-v1", "token-v2": "front-v2"},
		OnRequest: func(ri testserver.RequestInfo) {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.users[ri.User]++
			if ri.UserAgent == afterRotation {
				m.after++
				if ri.User != "front-v2" {
					m.violations = append(m.violations, fmt.Sprintf("cert %q token %q", ri.CertCN, ri.Token))
				}
			}
		},
	})
	var err error
	if m.v1, err = m.ca.IssueClient("front-v1"); err != nil {
		t.Fatal(err)
	}
	if m.v2, err = m.ca.IssueClient("front-v2"); err != nil {
		t.Fatal(err)
	}
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
		secret      func(m *rotationMember, version int) memberproxy.Secret
		newIdentity bool // the change makes a new TLS identity
	}{
		{"client certificate", func(m *rotationMember, v int) memberproxy.Secret {
			kp := map[int]*testserver.KeyPair{1: m.v1, 2: m.v2}[v]
			return memberproxy.Secret{CAData: m.ca.CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM}
		}, true},
		{"token", func(m *rotationMember, v int) memberproxy.Secret {
			return memberproxy.Secret{CAData: m.ca.CertPEM(), Token: fmt.Sprintf("token-v%d", v)}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newRotationMember(t)
			p := newPool(t, WithIdleTimeout(100*time.Millisecond))
			clusters := memberproxy.NewClusters()
			cluster := memberproxy.Cluster{Name: "member-1", APIEndpoint: m.srv.URL(), Secret: tc.secret(m, 1)}
			clusters.Set(cluster)
			fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: p.TransportFor})

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
					ua = afterRotation
				}
				err := fr.listNodes(ctx, "member-1", ua)
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
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Wrap(current); err != nil {
				t.Fatal(err)
			}
			afterLoad := p.Stats()
			waitFor(t, "old identity released", func() bool {
				runtime.GC()
				return p.Stats().Identities == 1
			})
			waitFor(t, "old identity's connections closed", func() bool {
				return m.srv.OpenConns() == p.Stats().OpenConns
			})
			st := m.srv.Stats()
			m.mu.Lock()
			t.Logf("%s rotated after %d of %d requests: member saw %v, %d requests sent after the rotation; "+
				"identities %d before, %d after the load, 1 after GC; member accepted %d connections, %d open now",
				tc.name, clients*requests/2, clients*requests, m.users, m.after,
				before.Identities, afterLoad.Identities, st.Accepted, st.Open)
			if len(m.violations) > 0 {
				t.Errorf("%d requests sent after the rotation used the old credentials: %v", len(m.violations), m.violations[:min(5, len(m.violations))])
			}
			if m.after == 0 || m.users["front-v1"] == 0 || m.users["front-v2"] == 0 {
				t.Errorf("the load did not straddle the rotation: %v, %d after", m.users, m.after)
			}
			m.mu.Unlock()
			if tc.newIdentity {
				// The old identity may be gone already: nothing refers to it
				// once the requests that used it are done.
				if afterLoad.Misses != 2 || afterLoad.Identities > 2 {
					t.Errorf("after a certificate change: %+v, want 2 identities built", afterLoad)
				}
				if st.Accepted > 4 {
					t.Errorf("member accepted %d connections, want at most 2 per certificate", st.Accepted)
				}
			} else {
				// A token is not part of the identity: the connections stay.
				if afterLoad.Misses != 1 {
					t.Errorf("a token change built a transport: %+v", afterLoad)
				}
				if st.Accepted > 2 {
					t.Errorf("member accepted %d connections, want at most 2: a token change needs none", st.Accepted)
				}
			}
			if st.Open > 2 || st.Open == 0 {
				t.Errorf("member has %d connections open, want the new identity's (1 or 2)", st.Open)
			}
			runtime.KeepAlive(current)
		})
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
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: p.TransportFor})
	ctx := context.Background()

	// member-2 has a long-lived client, as a controller would.
	held, err := memberproxy.RestConfig(staying)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Wrap(held); err != nil {
		t.Fatal(err)
	}
	checkNoErrors(t, runClients(10, 10, func(c, i int) error {
		return fr.listNodes(ctx, []string{"member-1", "member-2"}[(c+i)%2], "")
	}))

	// A watch through the front on member-1, running while it is deleted.
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	req, err := http.NewRequestWithContext(watchCtx, http.MethodGet, fr.clusterURL("member-1", "/api/v1/nodes?watch=true"), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := fr.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, `"ADDED"`) {
		t.Fatalf("watch through the front: %q, %v", line, err)
	}

	clusters.Delete("member-1")
	code, body, err := fr.get(ctx, "member-1", "/api/v1/nodes", "")
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
	if err := fr.listNodes(ctx, "member-2", ""); err != nil {
		t.Errorf("the other member: %v", err)
	}
	if st := stays.srv.Stats(); st.Accepted != 1 || st.Open != 1 {
		t.Errorf("the other member: %d connections accepted, %d open, want 1 and 1", st.Accepted, st.Open)
	}
	t.Logf("deleted cluster released: pool %+v; its member has %d connections open", p.Stats(), gone.srv.OpenConns())
	runtime.KeepAlive(held)
}

// TestProxyClusterOffline: the member stops for 10 s and restarts on the same
// port. Requests fail fast with a clear error while it is down, and succeed as
// soon as it is back.
func TestProxyClusterOffline(t *testing.T) {
	const down = 10 * time.Second
	member, other := newFixture(t, testserver.Options{}), newFixture(t, testserver.Options{})
	p := newPool(t)
	clusters := memberproxy.NewClusters()
	clusters.Set(certCluster("member-1", member, member.alice))
	clusters.Set(certCluster("member-2", other, other.alice))
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: p.TransportFor})
	ctx := context.Background()
	checkNoErrors(t, runClients(10, 10, func(int, int) error { return fr.listNodes(ctx, "member-1", "") }))

	if err := member.srv.Stop(); err != nil {
		t.Fatal(err)
	}
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
				code, body, err := fr.get(ctx, "member-1", "/api/v1/nodes", "")
				took := time.Since(start)
				var otherErr error
				if c == 0 {
					otherErr = fr.listNodes(ctx, "member-2", "") // the other member is unaffected
				}
				mu.Lock()
				failed++
				slowest = max(slowest, took)
				if err != nil || code != http.StatusServiceUnavailable ||
					!strings.Contains(string(body), `cluster \"member-1\" is unreachable`) || !strings.Contains(string(body), "connection refused") {
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

	if err := member.srv.Restart(); err != nil {
		t.Fatal(err)
	}
	member.srv.ResetStats()
	if err := fr.listNodes(ctx, "member-1", ""); err != nil {
		t.Errorf("first request after the member came back: %v", err)
	}
	checkNoErrors(t, runClients(100, 5, func(int, int) error { return fr.listNodes(ctx, "member-1", "") }))
	st := member.srv.Stats()
	if st.Accepted > 2 {
		t.Errorf("after the restart the member accepted %d connections, want at most 2", st.Accepted)
	}
	t.Logf("member down %v: %d requests failed with 503, slowest %v; back: first request succeeded, %d connections for 501 requests; pool %+v",
		down, failed, slowest.Round(time.Millisecond), st.Accepted, p.Stats())
}

// echoMember is a member API server that answers plain requests with the
// user it saw and upgrades SPDY requests (kubectl exec, attach,
// port-forward) to an echo: every stream it is given says hello and then
// echoes what it reads. It counts the connections it accepts.
type echoMember struct {
	url      string
	ca       *testserver.CA
	accepted atomic.Int64
	open     atomic.Int64

	mu       sync.Mutex // guards upgrades
	upgrades []string   // "user proto" of every upgrade request
}

func newEchoMember(t *testing.T, tokens map[string]string) *echoMember {
	t.Helper()
	ca, err := testserver.NewCA("echo-member-ca")
	if err != nil {
		t.Fatal(err)
	}
	serving, err := ca.IssueServer()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := serving.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	m := &echoMember{ca: ca}
	done := make(chan struct{})
	var handlers sync.WaitGroup
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user := tokens[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]
		if len(r.TLS.PeerCertificates) > 0 {
			user = r.TLS.PeerCertificates[0].Subject.CommonName
		}
		if user == "" {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		if !httpstream.IsUpgradeRequest(r) {
			fmt.Fprintf(w, "hello %s", user)
			return
		}
		m.mu.Lock()
		m.upgrades = append(m.upgrades, user+" "+r.Proto)
		m.mu.Unlock()
		handlers.Add(1)
		defer handlers.Done()
		// Like a process that exits when its stdin ends: the member closes
		// the connection once the stream is echoed. (Closing first also
		// keeps spdystream from parking its shutdown goroutine for 10
		// minutes, which it does when the peer closed the connection first.)
		echoed := make(chan struct{}, 1)
		conn := spdy.NewResponseUpgrader().UpgradeResponse(w, r, func(s httpstream.Stream, replySent <-chan struct{}) error {
			go func() {
				<-replySent
				_, _ = fmt.Fprintf(s, "hello %s\n", user)
				_, _ = io.Copy(s, s)
				s.Close()
				echoed <- struct{}{}
			}()
			return nil
		})
		if conn == nil {
			return
		}
		defer conn.Close()
		select {
		case <-echoed:
		case <-conn.CloseChan():
		case <-done:
		}
	})
	srv := &http.Server{
		Handler: handler,
		TLSConfig: &tls.Config{
			Certificates: []tls.Certificate{cert},
			ClientCAs:    ca.Pool(),
			ClientAuth:   tls.VerifyClientCertIfGiven,
		},
		ConnState: func(_ net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				m.accepted.Add(1)
				m.open.Add(1)
			case http.StateClosed, http.StateHijacked:
				m.open.Add(-1)
			}
		},
		ErrorLog: log.New(io.Discard, "", 0),
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m.url = "https://" + ln.Addr().String()
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() {
		close(done)
		srv.Close()
		<-served
		handlers.Wait()
	})
	return m
}

// exec opens a SPDY connection to cluster through the front, as kubectl exec
// does, and returns what the member said on a stream it was sent payload on.
func (fr *front) exec(ctx context.Context, cluster, payload string) (string, error) {
	rt, err := spdy.NewRoundTripperWithConfig(spdy.RoundTripperConfig{})
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost,
		fr.clusterURL(cluster, "/api/v1/namespaces/default/pods/echo/exec?command=cat&stdin=true&stdout=true"), nil)
	if err != nil {
		return "", err
	}
	req.Header.Set(httpstream.HeaderProtocolVersion, "v4.channel.k8s.io")
	req.Header.Set("Authorization", "Bearer caller-token-for-the-front")
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "", err
	}
	conn, err := rt.NewConnection(resp)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	stream, err := conn.CreateStream(http.Header{"streamType": {"stdin"}})
	if err != nil {
		return "", err
	}
	if _, err := io.WriteString(stream, payload); err != nil {
		return "", err
	}
	if err := stream.Close(); err != nil { // the end of stdin
		return "", err
	}
	got, err := io.ReadAll(stream)
	if err != nil {
		return "", err
	}
	select { // the member closes the connection when it is done
	case <-conn.CloseChan():
	case <-ctx.Done():
		return "", ctx.Err()
	}
	return string(got), nil
}

// TestProxyUpgrade: an exec-style SPDY upgrade through the front reaches the
// member on a connection of its own, authenticated as the front, and echoes
// data both ways; the pool's connections never carry it.
func TestProxyUpgrade(t *testing.T) {
	member := newEchoMember(t, map[string]string{"exec-token": "front-by-token"})
	front1, err := member.ca.IssueClient("front-by-cert")
	if err != nil {
		t.Fatal(err)
	}
	httpProxy := newConnectProxy(t)
	secret := memberproxy.Secret{CAData: member.ca.CertPEM(), CertData: front1.CertPEM, KeyData: front1.KeyPEM}
	clusters := memberproxy.NewClusters()
	clusters.Set(memberproxy.Cluster{Name: "by-cert", APIEndpoint: member.url, Secret: secret})
	clusters.Set(memberproxy.Cluster{Name: "by-token", APIEndpoint: member.url, Secret: memberproxy.Secret{CAData: member.ca.CertPEM(), Token: "exec-token"}})
	clusters.Set(memberproxy.Cluster{Name: "by-proxy", APIEndpoint: member.url, ProxyURL: httpProxy.URL(), Secret: secret})
	p := newPool(t)
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: p.TransportFor})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	for _, tc := range []struct{ cluster, user string }{
		{"by-cert", "front-by-cert"}, {"by-token", "front-by-token"}, {"by-proxy", "front-by-cert"},
	} {
		t.Run(tc.cluster, func(t *testing.T) {
			for range 5 {
				code, body, err := fr.get(ctx, tc.cluster, "/version", "")
				if err != nil || code != http.StatusOK || string(body) != "hello "+tc.user {
					t.Fatalf("plain request: %d %q %v", code, body, err)
				}
			}
			accepted, tunnels, pool := member.accepted.Load(), httpProxy.Stats().Tunnels, p.Stats()

			payload := "echo me, " + tc.cluster
			got, err := fr.exec(ctx, tc.cluster, payload)
			if err != nil {
				t.Fatal(err)
			}
			if want := "hello " + tc.user + "\n" + payload; got != want {
				t.Errorf("exec through the front: %q, want %q", got, want)
			}
			member.mu.Lock()
			last := member.upgrades[len(member.upgrades)-1]
			member.mu.Unlock()
			if last != tc.user+" HTTP/1.1" {
				t.Errorf("member saw the upgrade as %q, want %q", last, tc.user+" HTTP/1.1")
			}
			if n := member.accepted.Load() - accepted; n != 1 {
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
			waitFor(t, "upgrade connection closed", func() bool { return member.open.Load() == int64(pool.OpenConns) })
			t.Logf("%s: exec echoed %q; member accepted %d connections in all; pool %+v", tc.cluster, payload, member.accepted.Load(), after)
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
		kp, err := member.ca.IssueClient(fmt.Sprintf("front-%03d", i))
		if err != nil {
			t.Fatal(err)
		}
		clusters.Set(memberproxy.Cluster{Name: fmt.Sprintf("member-%03d", i), APIEndpoint: member.url, Secret: memberproxy.Secret{
			CAData: member.ca.CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM,
		}})
	}
	p := newPool(t, WithIdleTimeout(50*time.Millisecond))
	fr := newFront(t, &memberproxy.Front{Clusters: clusters, TransportFor: p.TransportFor})
	ctx := context.Background()
	// Warm the front (its client connections, the proxy code) on a cluster
	// of its own before measuring.
	warm, _ := clusters.Get("member-000")
	warm.Name = "warm-up"
	clusters.Set(warm)
	checkNoErrors(t, runClients(50, 2, func(int, int) error { return fr.listNodes(ctx, "warm-up", "") }))
	clusters.Delete("warm-up")
	waitFor(t, "warm-up identity released", func() bool { runtime.GC(); return p.Stats().Identities == 0 })
	waitFor(t, "warm-up connection closed", func() bool { return member.stats(t).Open == 0 })
	member.reset(t)

	// The test's own connections to the front live in this process too:
	// closed before every measurement.
	before := memStats(fr)
	// Every member is held by a client, as a controller would, so that the
	// identities stay while they are measured.
	held := make([]*rest.Config, identities)
	for i := range identities {
		cl, _ := clusters.Get(fmt.Sprintf("member-%03d", i))
		cfg, err := memberproxy.RestConfig(cl)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Wrap(cfg); err != nil {
			t.Fatal(err)
		}
		held[i] = cfg
	}
	wrapped := memStats(fr)
	// Three concurrent requests per identity, all at once.
	checkNoErrors(t, runClients(identities*3, 1, func(c, _ int) error {
		return fr.listNodes(ctx, fmt.Sprintf("member-%03d", c%identities), "")
	}))
	st := member.stats(t)
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
	waitFor(t, "connections closed", func() bool { return member.stats(t).Open == 0 })

	perID := func(a, b uint64) int64 { return (int64(a) - int64(b)) / identities }
	t.Logf("%d identities, one connection each (member accepted %d), per identity: heap %d bytes "+
		"(%d for the pool's transport, %d for the connection and what the requests left), "+
		"%d goroutine and %d bytes of stack; all released once unreferenced",
		identities, st.Accepted, perID(live.heap, before.heap), perID(wrapped.heap, before.heap),
		perID(live.heap, wrapped.heap), (live.goroutines-wrapped.goroutines)/identities, perID(live.stack, wrapped.stack))
	// The README's figures (about 52 KB per identity, 11 KB of it the
	// pool's transport), with room for the collector's timing.
	if got := perID(live.heap, before.heap); got > 64<<10 {
		t.Errorf("heap grew %d bytes per identity, want at most 64 KiB", got)
	}
	if got := perID(wrapped.heap, before.heap); got > 16<<10 {
		t.Errorf("Wrap took %d bytes of heap per identity, want at most 16 KiB", got)
	}
}

type memSnapshot struct {
	heap, stack uint64
	goroutines  int
}

// memStats measures the heap once fr's client connections are closed and
// the goroutines have settled.
func memStats(fr *front) memSnapshot {
	fr.client.CloseIdleConnections()
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

// memberProcess is a testserver run by this test binary in a child process
// (TestProxyMemberProcess), driven over its stdin and stdout.
type memberProcess struct {
	url string
	ca  *testserver.CA

	mu  sync.Mutex // guards the pipe
	in  io.Writer
	out *bufio.Reader
}

const memberDirEnv = "SHAREDTRANSPORT_MEMBER_PROCESS_DIR"

func startMemberProcess(t *testing.T) *memberProcess {
	t.Helper()
	ca, err := testserver.NewCA("member-process-ca")
	if err != nil {
		t.Fatal(err)
	}
	serving, err := ca.IssueServer()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{"ca.crt": ca.CertPEM(), "tls.crt": serving.CertPEM, "tls.key": serving.KeyPEM} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestProxyMemberProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), memberDirEnv+"="+dir)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.Close() // the child stops at EOF
		if err := cmd.Wait(); err != nil {
			t.Errorf("member process: %v", err)
		}
	})
	m := &memberProcess{ca: ca, in: in, out: bufio.NewReader(out)}
	line, err := m.out.ReadString('\n')
	if err != nil {
		t.Fatalf("member process: %v", err)
	}
	m.url = strings.TrimSpace(line)
	return m
}

func (m *memberProcess) call(t testing.TB, command string) string {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := io.WriteString(m.in, command+"\n"); err != nil {
		t.Fatal(err)
	}
	line, err := m.out.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func (m *memberProcess) stats(t testing.TB) testserver.Stats {
	var st testserver.Stats
	if err := json.Unmarshal([]byte(m.call(t, "stats")), &st); err != nil {
		t.Fatal(err)
	}
	return st
}

func (m *memberProcess) reset(t testing.TB) { m.call(t, "reset") }

// TestProxyMemberProcess is the member server of TestProxyManyIdentities when
// run as its child process; otherwise it is skipped.
func TestProxyMemberProcess(t *testing.T) {
	dir := os.Getenv(memberDirEnv)
	if dir == "" {
		t.Skip("the member server of TestProxyManyIdentities, run in a child process")
	}
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	caPEM, certPEM, keyPEM := read("ca.crt"), read("tls.crt"), read("tls.key")
	block, _ := pem.Decode(certPEM)
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	clientCAs := x509.NewCertPool()
	clientCAs.AppendCertsFromPEM(caPEM)
	srv, err := testserver.Start(testserver.Options{
		ServerCert: &testserver.KeyPair{CertPEM: certPEM, KeyPEM: keyPEM, Cert: leaf},
		ClientCAs:  clientCAs,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	fmt.Println(srv.URL())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "stats":
			b, _ := json.Marshal(srv.Stats())
			fmt.Println(string(b))
		case "reset":
			srv.ResetStats()
			fmt.Println("ok")
		default:
			fmt.Println("unknown command")
		}
	}
}
