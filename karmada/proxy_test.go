package karmada

import (
	"context"
	"crypto/tls"
	"strings"
	"testing"
	"time"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/spdyecho"
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
// pool as Karmada refuses it (GetTLSConfigForCluster asks for TLS 1.3).
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
	for _, m := range []mode{connectCluster, asIs, pooled} {
		proxy := newProxy(t)
		cl, sec := member("old", srv.URL(), proxy, ca.CertPEM())
		f := &front{mode: m, secrets: sec, cluster: cl, pool: sharedtransport.New()}
		_, err := whoAmI(context.Background(), httpClient(), serveFront(t, f), "someone")
		f.pool.Close()
		if err == nil || !strings.Contains(err.Error(), "protocol version") {
			t.Errorf("%s: got %v, want the handshake refused", m, err)
		}
		if n := srv.Stats().Requests; n != 0 {
			t.Errorf("%s: the TLS 1.2 member served %d requests", m, n)
		}
	}
}

// TestCABundleChange: a new caBundle in the cluster's Secret takes effect
// on the next request through the pool: a bundle without the member's CA
// fails at once, one with it works at once.
func TestCABundleChange(t *testing.T) {
	proxy := newProxy(t)
	cl, sec := member("member1", kube.URL, proxy, kube.ServingCA.CertPEM())
	pool := sharedtransport.New(sharedtransport.WithIdleTimeout(time.Second))
	defer pool.Close()
	url := serveFront(t, &front{mode: pooled, secrets: sec, cluster: cl, pool: pool})
	hc := httpClient()
	if _, err := whoAmI(context.Background(), hc, url, "a"); err != nil {
		t.Fatal(err)
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
	if n := proxy.Stats().Tunnels; n != 3 {
		t.Errorf("%d tunnels for three bundles, want 3", n)
	}
}

// TestExecThroughHandler: an exec (SPDY) through ConnectCluster's handler
// with the pool's transport: the upgrade goes through Karmada's own
// UpgradeDialer, through the proxy with the cluster's header. The member
// is a SPDY echo (the e2e kube-apiserver has no kubelet to exec in).
func TestExecThroughHandler(t *testing.T) {
	echo, err := spdyecho.Start(map[string]string{token: "karmada-impersonator"})
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	proxy := newProxy(t)
	cl, sec := member("echo", echo.URL, proxy, echo.CA.CertPEM())
	pool := sharedtransport.New()
	defer pool.Close()
	url := serveFront(t, &front{mode: pooledConnect, secrets: sec, cluster: cl, pool: pool})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := spdyecho.Exec(ctx, url+"/api/v1/namespaces/default/pods/p/exec", "", "ping")
	if err != nil {
		t.Fatal(err)
	}
	if want := "hello karmada-impersonator\nping"; got != want {
		t.Errorf("exec said %q, want %q", got, want)
	}
	if st := proxy.Stats(); st.Tunnels != 1 || st.Rejected != 0 {
		t.Errorf("proxy %+v, want one tunnel and none refused", st)
	}
}
