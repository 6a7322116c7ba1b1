package fakeopenstack

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gophercloud/gophercloud/v2"
	"github.com/gophercloud/gophercloud/v2/openstack"
	"github.com/gophercloud/gophercloud/v2/openstack/compute/v2/servers"
)

// client authenticates user with password against s through rt, as
// gophercloud does for CAPO.
func client(t *testing.T, s *Server, rt http.RoundTripper, user, password string) (*gophercloud.ProviderClient, error) {
	t.Helper()
	provider, err := openstack.NewClient(s.URL + "/v3")
	if err != nil {
		t.Fatal(err)
	}
	provider.HTTPClient.Transport = rt
	return provider, openstack.Authenticate(context.Background(), provider, gophercloud.AuthOptions{
		IdentityEndpoint: s.URL + "/v3", Username: user, Password: password, DomainName: "Default",
		TenantName: "project-" + user, AllowReauth: true,
	})
}

func transport(t *testing.T, s *Server) *http.Transport {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(s.CA) {
		t.Fatal("the server's CA does not parse")
	}
	return &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, ForceAttemptHTTP2: true}
}

// TestServesWhatCAPOAsks: a token for each user, the compute service from
// the catalog, Nova's version document and each user's own servers; a
// wrong password is refused; the server counts what it saw.
func TestServesWhatCAPOAsks(t *testing.T) {
	for _, http1 := range []bool{false, true} {
		s, err := Start(Options{HTTP1Only: http1, Users: map[string]string{"alice": "a-pass", "bob": "b-pass"}})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		rt := transport(t, s)
		for _, user := range []string{"alice", "bob"} {
			provider, err := client(t, s, rt, user, user[:1]+"-pass")
			if err != nil {
				t.Fatalf("authenticate %s: %v", user, err)
			}
			compute, err := openstack.NewComputeV2(provider, gophercloud.EndpointOpts{Region: Region})
			if err != nil {
				t.Fatalf("the compute service from %s's catalog: %v", user, err)
			}
			var version struct {
				Version struct {
					Version    string `json:"version"`
					MinVersion string `json:"min_version"`
				} `json:"version"`
			}
			if _, err := compute.Request(context.Background(), "GET", compute.Endpoint, &gophercloud.RequestOpts{JSONResponse: &version, OkCodes: []int{200}}); err != nil || version.Version.MinVersion != "2.1" {
				t.Errorf("Nova's version document for %s: %+v, %v", user, version, err)
			}
			pages, err := servers.List(compute, servers.ListOpts{}).AllPages(context.Background())
			if err != nil {
				t.Fatalf("list %s's servers: %v", user, err)
			}
			list, err := servers.ExtractServers(pages)
			if err != nil || len(list) != 1 || list[0].Name != "server-of-"+user {
				t.Errorf("%s's servers: %+v, %v; want one, server-of-%s", user, list, err, user)
			}
		}
		if _, err := client(t, s, rt, "alice", "wrong"); !errors.As(err, new(gophercloud.ErrUnexpectedResponseCode)) {
			t.Errorf("a wrong password: %v, want a refusal", err)
		}
		c := s.Counts()
		t.Logf("HTTP/1.1 only %v: %+v", http1, c)
		if c.Tokens != 2 || c.Requests != 4 || c.WrongTokens != 0 || c.Accepted < 1 || c.FullHandshakes < 1 {
			t.Errorf("HTTP/1.1 only %v: counted %+v, want 2 tokens, 4 Nova requests, none wrong", http1, c)
		}
		rt.CloseIdleConnections()
	}
}

// TestTokensExpire: a token past its lifetime is refused and counted, and
// gophercloud authenticates again (AllowReauth) and goes on.
func TestTokensExpire(t *testing.T) {
	s, err := Start(Options{TokenLifetime: 300 * time.Millisecond, Users: map[string]string{"alice": "a-pass"}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	provider, err := client(t, s, transport(t, s), "alice", "a-pass")
	if err != nil {
		t.Fatal(err)
	}
	compute, err := openstack.NewComputeV2(provider, gophercloud.EndpointOpts{Region: Region})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond) // the token expires
	if _, err := servers.List(compute, servers.ListOpts{}).AllPages(context.Background()); err != nil {
		t.Fatalf("list after the token expired: %v", err)
	}
	if c := s.Counts(); c.WrongTokens != 1 || c.Tokens != 2 {
		t.Errorf("counted %+v, want the expired token refused once and a second token issued", c)
	}
}

func TestMain(m *testing.M) {
	if code, isChild := Main(); isChild {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// TestProcess: a server in a child process serves and counts as one in
// this process does, and the connection this process keeps toward it is
// the one ESTABLISHED socket counted here.
func TestProcess(t *testing.T) {
	p, err := StartProcess(context.Background(), Options{Users: map[string]string{"alice": "a-pass"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	rt := transport(t, &Server{URL: p.URL, CA: p.CA})
	defer rt.CloseIdleConnections()
	if _, err := client(t, &Server{URL: p.URL}, rt, "alice", "a-pass"); err != nil {
		t.Fatal(err)
	}
	c, err := p.Counts(context.Background())
	if err != nil || c.Tokens != 1 || c.Accepted != 1 || c.Open != 1 {
		t.Errorf("the child counted %+v, %v; want 1 token, 1 connection accepted and open", c, err)
	}
	if n, err := Established(p.URL); err != nil || n != 1 {
		t.Errorf("ESTABLISHED toward the child: %d, %v; want 1", n, err)
	}
	rt.CloseIdleConnections()
	n, err := Established(p.URL)
	for deadline := time.Now().Add(5 * time.Second); (err != nil || n != 0) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		n, err = Established(p.URL)
	}
	if err != nil || n != 0 {
		t.Errorf("ESTABLISHED toward the child after closing: %d, %v; want 0", n, err)
	}
}

// TestProxyResolves: a server known by a name only the proxy resolves is
// reached through it, as a site's egress proxy reaches its cloud; the
// tokens issued are listed.
func TestProxyResolves(t *testing.T) {
	const host = "openstack.fakeopenstack.test"
	s, err := Start(Options{Host: host, Users: map[string]string{"alice": "a-pass"}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := StartProxy(map[string]string{host: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	proxyURL, _ := url.Parse(p.URL())
	rt := transport(t, s)
	rt.Proxy = http.ProxyURL(proxyURL)
	defer rt.CloseIdleConnections()
	provider, err := client(t, s, rt, "alice", "a-pass")
	if err != nil {
		t.Fatal(err)
	}
	if provider.Token() == "" || !slices.Equal(s.Tokens(), []string{provider.Token()}) {
		t.Errorf("tokens issued %q, the client's %q", s.Tokens(), provider.Token())
	}
	if !strings.HasPrefix(s.URL, "https://"+host+":") || p.Tunnels() != 1 {
		t.Errorf("URL %s, %d tunnels; want the name and 1 tunnel", s.URL, p.Tunnels())
	}
}
