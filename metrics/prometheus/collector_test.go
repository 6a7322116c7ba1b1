package prometheus

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport"
)

// clientCert returns a self-signed client certificate and its key, PEM.
func clientCert(t *testing.T, cn string, notAfter time.Time) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}

// TestCollector scrapes a pool whose two identities sent requests to an
// HTTP/2 TLS server that requires client certificates, and compares the
// scrape with what the server counted.
func TestCollector(t *testing.T) {
	var accepted, open atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, r.TLS.PeerCertificates[0].Subject.CommonName)
	}))
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{ClientAuth: tls.RequireAnyClientCert}
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			accepted.Add(1)
			open.Add(1)
		case http.StateClosed, http.StateHijacked:
			open.Add(-1)
		}
	}
	srv.StartTLS()
	defer srv.Close()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})

	p := sharedtransport.New()
	defer p.Close()
	notAfter := map[string]time.Time{"alice": time.Now().Add(48 * time.Hour).Truncate(time.Second), "bob": time.Now().Add(72 * time.Hour).Truncate(time.Second)}
	var cfgs []*rest.Config
	for _, cn := range []string{"alice", "bob"} {
		cert, key := clientCert(t, cn, notAfter[cn])
		cfg := &rest.Config{Host: srv.URL, TLSClientConfig: rest.TLSClientConfig{CAData: caPEM, CertData: cert, KeyData: key}}
		if err := p.Wrap(cfg); err != nil {
			t.Fatal(err)
		}
		client, err := rest.HTTPClientFor(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			resp, err := client.Get(srv.URL)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(b) != cn {
				t.Fatalf("server saw %q, want %q", b, cn)
			}
		}
		cfgs = append(cfgs, cfg)
	}
	if accepted.Load() != 2 || open.Load() != 2 {
		t.Fatalf("server accepted %d connections, %d open; want 2 and 2", accepted.Load(), open.Load())
	}

	c := NewCollector(p)
	want := fmt.Sprintf(`
# HELP sharedtransport_connections TCP connections open now.
# TYPE sharedtransport_connections gauge
sharedtransport_connections %d
# HELP sharedtransport_dials_total TCP connections dialed.
# TYPE sharedtransport_dials_total counter
sharedtransport_dials_total %d
# HELP sharedtransport_handshakes_total TLS handshakes, by kind: full or resumed.
# TYPE sharedtransport_handshakes_total counter
sharedtransport_handshakes_total{kind="full"} 2
sharedtransport_handshakes_total{kind="resumed"} 0
# HELP sharedtransport_identities Identities with a live transport.
# TYPE sharedtransport_identities gauge
sharedtransport_identities 2
`, open.Load(), accepted.Load())
	if err := testutil.CollectAndCompare(c, strings.NewReader(want),
		"sharedtransport_connections", "sharedtransport_dials_total", "sharedtransport_handshakes_total", "sharedtransport_identities"); err != nil {
		t.Error(err)
	}

	var perIdentity strings.Builder
	perIdentity.WriteString(`# HELP sharedtransport_certificate_expiry_timestamp_seconds When the client certificate the identity presents expires, in Unix seconds.
# TYPE sharedtransport_certificate_expiry_timestamp_seconds gauge
`)
	conns := "# HELP sharedtransport_identity_connections TCP connections of the identity open now.\n# TYPE sharedtransport_identity_connections gauge\n"
	infos := p.Identities()
	if len(infos) != 2 {
		t.Fatalf("%d identities, want 2", len(infos))
	}
	for _, id := range infos {
		fmt.Fprintf(&perIdentity, "sharedtransport_certificate_expiry_timestamp_seconds{host=%q,identity=%q} %d\n", srv.URL, id.Name, notAfter[id.CertSubject].Unix())
		conns += fmt.Sprintf("sharedtransport_identity_connections{host=%q,identity=%q} 1\n", srv.URL, id.Name)
	}
	perIdentity.WriteString(conns)
	if err := testutil.CollectAndCompare(c, strings.NewReader(perIdentity.String()),
		"sharedtransport_certificate_expiry_timestamp_seconds", "sharedtransport_identity_connections"); err != nil {
		t.Error(err)
	}
	// 10 pool series (handshakes has two), 7 per identity with a
	// certificate and no reload error (handshakes has two).
	if n := testutil.CollectAndCount(c); n != 10+2*7 {
		t.Errorf("scrape has %d series, want %d", n, 10+2*7)
	}
	if problems, err := testutil.CollectAndLint(c); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}
	runtime.KeepAlive(cfgs) // their identities stay live through the scrapes
}

// TestCollectorDefaultPool: the package's default pool, which the
// package-level functions use, is reachable and can be collected.
func TestCollectorDefaultPool(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, r.TLS.PeerCertificates[0].Subject.CommonName)
	}))
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{ClientAuth: tls.RequireAnyClientCert}
	srv.StartTLS()
	defer srv.Close()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	cert, key := clientCert(t, "alice", time.Now().Add(time.Hour))
	cfg := &rest.Config{Host: srv.URL, TLSClientConfig: rest.TLSClientConfig{CAData: caPEM, CertData: cert, KeyData: key}}
	if err := sharedtransport.Wrap(cfg); err != nil {
		t.Fatal(err)
	}
	client, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	want := `
# HELP sharedtransport_handshakes_total TLS handshakes, by kind: full or resumed.
# TYPE sharedtransport_handshakes_total counter
sharedtransport_handshakes_total{kind="full"} 1
sharedtransport_handshakes_total{kind="resumed"} 0
# HELP sharedtransport_identities Identities with a live transport.
# TYPE sharedtransport_identities gauge
sharedtransport_identities 1
`
	if err := testutil.CollectAndCompare(NewCollector(sharedtransport.Default()), strings.NewReader(want),
		"sharedtransport_handshakes_total", "sharedtransport_identities"); err != nil {
		t.Error(err)
	}
	runtime.KeepAlive(cfg)
	if err := sharedtransport.Default().Close(); err != nil {
		t.Fatal(err)
	}
	if err := sharedtransport.Wrap(&rest.Config{Host: srv.URL}); !errors.Is(err, sharedtransport.ErrClosed) {
		t.Errorf("Wrap on the closed default pool: %v, want ErrClosed", err)
	}
}
