package memberproxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

// get lists nodes on cluster through the front and returns the status and
// body.
func get(t *testing.T, front, cluster string) (int, string) {
	t.Helper()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Get(front + PathPrefix + cluster + "/proxy/api/v1/nodes")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// upgrade sends an upgrade request to cluster through the front on a
// connection of its own, as kubectl exec does, and returns what the member
// echoes of payload.
func upgrade(t *testing.T, front, cluster, payload string) (string, error) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(front, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "GET %s%s/proxy/api/v1/namespaces/default/pods/p/exec HTTP/1.1\r\nHost: front\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n", PathPrefix, cluster)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(resp.Body)
		return "", fmt.Errorf("%s: %s", resp.Status, body)
	}
	if _, err := io.WriteString(conn, payload); err != nil {
		return "", err
	}
	got := make([]byte, len(payload))
	_, err = io.ReadFull(br, got)
	return string(got), err
}

// A member behind a CONNECT proxy that answers 407 without the cluster's
// ProxyHeader: in every mode, and for upgrades, the front's CONNECTs carry
// the header, so the proxy refuses none and opens a tunnel per connection the
// member accepts. Without the header, the proxy refuses the front (the
// control).
func TestProxyHeader(t *testing.T) {
	member, err := testserver.Start(testserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer member.Close()
	kp, err := member.CA().IssueClient("front")
	if err != nil {
		t.Fatal(err)
	}
	const cred = "Basic ZnJvbnQ6c2VjcmV0"
	p, err := connectproxy.Start(connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: []string{cred}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	clusters := NewClusters()
	cl := Cluster{Name: "proxied", APIEndpoint: member.URL(), ProxyURL: p.URL(),
		ProxyHeader: http.Header{"Proxy-Authorization": {cred}},
		Secret:      Secret{CAData: member.CA().CertPEM(), CertData: kp.CertPEM, KeyData: kp.KeyPEM}}
	clusters.Set(cl)
	cl.Name, cl.ProxyHeader = "no-header", nil
	clusters.Set(cl)

	for _, mode := range []Mode{TransportFor, NewTransport, NewTransportNoKeepAlive} {
		t.Run(mode.String(), func(t *testing.T) {
			member.ResetStats()
			p.ResetStats()
			front := httptest.NewServer(&Front{Clusters: clusters, Mode: mode})
			defer front.Close()
			for range 3 {
				if code, body := get(t, front.URL, "proxied"); code != http.StatusOK || !strings.Contains(body, `"NodeList"`) {
					t.Fatalf("list through the proxy: %d %s", code, body)
				}
			}
			if echo, err := upgrade(t, front.URL, "proxied", "ping"); err != nil || echo != "ping" {
				t.Fatalf("upgrade through the proxy: %q, %v", echo, err)
			}
			st, ms := p.Stats(), member.Stats()
			if st.Rejected != 0 || st.Tunnels != ms.Accepted || ms.Accepted == 0 || ms.Upgrades != 1 {
				t.Errorf("proxy %+v, member accepted %d with %d upgrades; want 0 refused, a tunnel per connection, 1 upgrade", st, ms.Accepted, ms.Upgrades)
			}
			for _, tun := range p.Tunnels() {
				if got := tun.Header.Get("Proxy-Authorization"); got != cred {
					t.Errorf("tunnel to %s with Proxy-Authorization %q", tun.Target, got)
				}
			}

			if code, body := get(t, front.URL, "no-header"); code != http.StatusServiceUnavailable || !strings.Contains(body, "Proxy Authentication Required") {
				t.Errorf("list without the header: %d %s, want the proxy's 407 as a 503", code, body)
			}
			if _, err := upgrade(t, front.URL, "no-header", "ping"); err == nil || !strings.Contains(err.Error(), "Proxy Authentication Required") {
				t.Errorf("upgrade without the header: %v, want the proxy's 407", err)
			}
			if st := p.Stats(); st.Rejected != 2 {
				t.Errorf("proxy refused %d CONNECTs without the header, want 2", st.Rejected)
			}
		})
	}
}
