package karmada

import (
	"context"
	"crypto/tls"
	"strings"
	"testing"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestConnectClusterAsIs: Karmada's ConnectCluster, called per proxied
// request, opens one tunnel per request.
func TestConnectClusterAsIs(t *testing.T) {
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	url := serveFront(t, &front{mode: connectCluster, secrets: sec, cluster: cl})
	res := load(t, url, 10, 5)
	if res.ok != 50 || proxy.Stats().Tunnels != 50 || proxy.Stats().Rejected != 0 {
		t.Errorf("%d of 50 right, %+v at the proxy, want 50 tunnels and none refused; first error: %v", res.ok, proxy.Stats(), res.firstErr.Load())
	}
}

// TestTLS12Refused: a member that speaks TLS 1.2 at most is refused on the
// pool (patched Karmada) as Karmada as is refuses it (GetTLSConfigForCluster
// asks for TLS 1.3).
func TestTLS12Refused(t *testing.T) {
	ca, err := testserver.NewCA("tls12-ca")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := testserver.Start(testserver.Options{CA: ca, MaxTLSVersion: tls.VersionTLS12,
		ClientAuth: testserver.VerifyClientCertIfGiven, Tokens: map[string]string{token: "karmada"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	modes := []mode{connectCluster, asIs}
	if patched {
		modes = []mode{connectCluster, pooled} // ConnectCluster on Karmada's own pool, Location on the front's
	}
	for _, m := range modes {
		proxy := newProxy(t)
		cl, sec := member("old", srv.URL(), proxy, ca.CertPEM())
		f := &front{mode: m, secrets: sec, cluster: cl}
		if m == pooled {
			f.pool = sharedtransport.New()
			defer clusterTransports(f.pool)()
		}
		_, err := whoAmI(context.Background(), httpClient(), serveFront(t, f), "someone")
		if err == nil || !strings.Contains(err.Error(), "protocol version") {
			t.Errorf("%s: got %v, want the handshake refused", m, err)
		}
		if n := srv.Stats().Requests; n != 0 {
			t.Errorf("%s: the TLS 1.2 member served %d requests", m, n)
		}
	}
}
