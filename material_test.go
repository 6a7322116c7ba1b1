package sharedtransport

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// badFile is one way a file can be wrong. apply breaks it; which file is
// named in the error, and the reason given; also, where the error says more,
// what else it names (both files of a pair, a certificate's dates).
type badFile struct {
	name   string
	apply  func(t testing.TB, c *certDir)
	file   func(c *certDir) string
	reason string
	more   func(c *certDir) []string
}

func badFiles(t testing.TB, f *fixture, otherCA *testserver.CA) []badFile {
	t.Helper()
	write := func(pick func(*certDir) string, b []byte) func(testing.TB, *certDir) {
		return func(t testing.TB, c *certDir) {
			t.Helper()
			must(t, os.WriteFile(pick(c), b, 0o600))
		}
	}
	ca := func(c *certDir) string { return c.ca }
	cert := func(c *certDir) string { return c.cert }
	key := func(c *certDir) string { return c.key }
	dates := func(kp *testserver.KeyPair) func(*certDir) []string {
		return func(*certDir) []string { return []string{stamp(kp.Cert.NotBefore), stamp(kp.Cert.NotAfter)} }
	}
	expired := issueValid(t, f.ca, "expired", -48*time.Hour, -24*time.Hour)
	ahead := issueValid(t, f.ca, "an hour ahead", time.Hour, 25*time.Hour)
	caPEM := f.ca.CertPEM()
	bundle := append(append([]byte{}, caPEM...), otherCA.CertPEM()...)
	return []badFile{
		{"torn certificate", write(cert, f.alice.CertPEM[:len(f.alice.CertPEM)/2]), cert, "do not form a valid pair", nil},
		{"torn key", write(key, f.alice.KeyPEM[:len(f.alice.KeyPEM)/2]), key, "do not form a valid pair", nil},
		{"torn CA bundle", write(ca, bundle[:len(bundle)-len(otherCA.CertPEM())/2]), ca, "incomplete PEM block", nil},
		{"empty certificate", write(cert, nil), cert, "is empty", nil},
		{"empty key", write(key, []byte("\n  \n")), key, "is empty", nil},
		{"empty CA", write(ca, nil), ca, "is empty", nil},
		{"key in the certificate file", write(cert, f.alice.KeyPEM), cert, "do not form a valid pair", nil},
		{"certificate in the key file", write(key, f.alice.CertPEM), key, "do not form a valid pair", nil},
		{"key in the CA file", write(ca, f.alice.KeyPEM), ca, `"EC PRIVATE KEY" PEM block where CA certificates are expected`, nil},
		{"CA file that is not PEM", write(ca, []byte("not a certificate\n")), ca, "holds no PEM certificate", nil},
		// A log or disk image where the certificate belongs is not read to
		// its end.
		{"certificate file larger than any certificate", write(cert, bytes.Repeat([]byte("x"), maxMaterialFile+1)), cert, "more than the", nil},
		{"key of another certificate", write(key, f.bob.KeyPEM), key, "do not form a valid pair", func(c *certDir) []string { return []string{c.cert} }},
		// Running as root, a mode of 000 does not stop a read; a directory
		// where a file belongs does.
		{"directory instead of the key file", func(t testing.TB, c *certDir) {
			t.Helper()
			must(t, os.Remove(c.key))
			must(t, os.Mkdir(c.key, 0o700))
		}, key, "is not a regular file (mode d", nil},
		{"certificate file deleted", remove(cert), cert, "no such file or directory", nil},
		{"CA file deleted", remove(ca), ca, "no such file or directory", nil},
		{"expired certificate", writePair(expired), cert, "has expired", dates(expired)},
		{"certificate valid an hour from now", writePair(ahead), cert, "is not valid yet", dates(ahead)},
		{"CA bundle whose every certificate expired", func(t testing.TB, c *certDir) {
			t.Helper()
			write(ca, append(expiredCA(t, "old-ca-1"), expiredCA(t, "old-ca-2")...))(t, c)
		}, ca, "every one has expired", nil},
	}
}

// remove returns a badFile apply that deletes the file pick names.
func remove(pick func(*certDir) string) func(testing.TB, *certDir) {
	return func(t testing.TB, c *certDir) {
		t.Helper()
		must(t, os.Remove(pick(c)))
	}
}

// writePair returns a badFile apply that writes kp's certificate and key.
func writePair(kp *testserver.KeyPair) func(testing.TB, *certDir) {
	return func(t testing.TB, c *certDir) {
		t.Helper()
		writeAtomic(t, c.key, kp.KeyPEM)
		writeAtomic(t, c.cert, kp.CertPEM)
	}
}

func issueValid(t testing.TB, ca *testserver.CA, cn string, from, until time.Duration) *testserver.KeyPair {
	t.Helper()
	now := time.Now()
	kp, err := ca.Issue(testserver.CertSpec{CommonName: cn, Client: true, NotBefore: now.Add(from), NotAfter: now.Add(until)})
	must(t, err)
	return kp
}

// expiredCA is a self-signed CA certificate that expired a day ago.
func expiredCA(t testing.TB, cn string) []byte {
	t.Helper()
	kp, err := testserver.SelfSigned(testserver.CertSpec{CommonName: cn, CA: true,
		NotBefore: time.Now().Add(-365 * 24 * time.Hour), NotAfter: time.Now().Add(-24 * time.Hour)})
	must(t, err)
	return kp.CertPEM
}

// TestBadFilesAtWrap: when nothing good was ever loaded, Wrap fails with an
// error naming the bad file and what is wrong with it, and no key material;
// so does Wrap(nil).
func TestBadFilesAtWrap(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	p := newPool(t)
	for i, bf := range badFiles(t, f, otherCA) {
		t.Run(bf.name, func(t *testing.T) {
			c := writeCredFiles(t, filepath.Join(f.dir, "wrap", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
			bf.apply(t, c)
			err := p.Wrap(c.config(f.srv.URL()))
			if err == nil {
				t.Fatal("Wrap succeeded")
			}
			t.Logf("%v", err)
			want := []string{bf.file(c), bf.reason}
			if bf.more != nil {
				want = append(want, bf.more(c)...)
			}
			for _, w := range want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not say %q", w)
				}
			}
			// The reason may name a PEM block's type; nothing else may.
			if rest := strings.ReplaceAll(err.Error(), bf.reason, ""); strings.Contains(rest, "PRIVATE KEY") || strings.Contains(rest, string(f.alice.KeyPEM[40:80])) {
				t.Errorf("error leaks key material: %q", err)
			}
		})
	}
	if err := p.Wrap(nil); err == nil {
		t.Error("Wrap(nil) succeeded")
	}
	if st := p.Stats(); st.Identities != 0 {
		t.Errorf("failed Wraps left %d identities", st.Identities)
	}
}

// TestBadFilesAfterGood: once good material was loaded, every bad version of
// the files is rejected, counted, and logged with the file and what is
// wrong, and clients keep working with the last
// good certificate (the server checks which one it sees, on new connections);
// the next good files are taken.
//
// That holds for clients built before the files went bad: long-lived
// clientsets, informers. A client built while the files are bad is built by
// client-go, which reads the files itself (at most once a second): it gets
// client-go's error, or, when client-go could build a transport, its TLS
// material differs from the identity's and the hook passes it through, as it
// must for a copy pointed at other files. The test records what fresh
// clients saw and checks that no request ever carried another certificate.
func TestBadFilesAfterGood(t *testing.T) {
	ledger := newConnLedger()
	f := newFixture(t, testserver.Options{OnRequest: ledger.onRequest})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	logs := &logLines{}
	p := newPool(t, withDebounce(10*time.Millisecond), WithLogger(logs.logger()))
	c := writeCredFiles(t, filepath.Join(f.dir, "rotate"), f.ca.CertPEM(), f.alice)
	var cn atomic.Value // the CN the files hold, read per request
	cn.Store("alice")
	cfg := c.config(f.srv.URL())
	cfg.QPS, cfg.Burst = 1e6, 1e6
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			return (&tagRoundTripper{next: rt, tag: "rotating", cn: cn.Load().(string)}).RoundTrip(req)
		})
	})
	if err := p.Wrap(cfg, WithPerRequestWrappers()); err != nil { // the tag leaves connections alone
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	longLived, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	r := &badFilesRig{f: f, p: p, c: c, cfg: cfg, ledger: ledger, logs: logs, ctx: ctx, longLived: longLived}
	must(t, r.list())

	fresh := map[string]int{}
	bad := badFiles(t, f, otherCA)
	for _, bf := range bad {
		t.Run(bf.name, func(t *testing.T) { r.rejected(t, bf, fresh) })
	}
	t.Logf("clients built while the files were bad: %s", sortedCounts(fresh))

	t.Run("good files after all that", func(t *testing.T) {
		before := p.Stats()
		cn.Store("bob")
		writeAtomic(t, c.key, f.bob.KeyPEM)
		writeAtomic(t, c.cert, f.bob.CertPEM)
		waitFor(t, "the rotation", func() bool { return p.Stats().Rotations > before.Rotations })
		r.newConnection(t)
		must(t, r.list())
		r.checkServer(t)
		// client-go re-reads the files at most once a second; then fresh
		// clients match the identity again and share its transport.
		waitFor(t, "a fresh client shares the rotated transport", func() bool {
			pass := p.Stats().PassThrough
			return listNodes(ctx, cfg) == nil && p.Stats().PassThrough == pass
		})
		r.checkServer(t)
	})
	t.Logf("pool after %d bad files: %+v", len(bad), p.Stats())
}

// badFilesRig is TestBadFilesAfterGood's pool, its files and a client
// built while they were good.
type badFilesRig struct {
	f         *fixture
	p         *Pool
	c         *certDir
	cfg       *rest.Config
	ledger    *connLedger
	logs      *logLines
	ctx       context.Context
	longLived *kubernetes.Clientset
}

// list lists nodes with the long-lived client.
func (r *badFilesRig) list() error {
	_, err := r.longLived.CoreV1().Nodes().List(r.ctx, metav1.ListOptions{})
	return err
}

// newConnection makes the next request handshake again, with whatever
// material the pool holds now.
func (r *badFilesRig) newConnection(t *testing.T) {
	t.Helper()
	r.f.srv.CloseClientConnections()
	waitFor(t, "the pool sees its connection closed", func() bool { return r.p.Stats().OpenConns == 0 })
}

func (r *badFilesRig) checkServer(t *testing.T) {
	t.Helper()
	if _, _, mismatches, _ := r.ledger.snapshot(); len(mismatches) > 0 {
		t.Fatalf("the server saw another certificate: %v", mismatches)
	}
}

// rejected writes bf over the good files and checks that it is rejected
// with a log line naming it, that clients keep the last good material, and
// that the good files are taken again; fresh counts what a client built
// while bf was there got.
func (r *badFilesRig) rejected(t *testing.T, bf badFile, fresh map[string]int) {
	f, p, c := r.f, r.p, r.c
	t.Cleanup(func() { c.restore(t, f.ca.CertPEM(), f.alice) })
	before := p.Stats()
	bf.apply(t, c)
	waitFor(t, "the bad file is rejected", func() bool { return p.Stats().RotationErrors > before.RotationErrors })
	want := []string{bf.file(c), strings.Trim(strconv.Quote(bf.reason), `"`)}
	if bf.more != nil {
		want = append(want, bf.more(c)...)
	}
	// The line is logged just after the rejection is counted.
	waitFor(t, fmt.Sprintf("a log line keeping the last good material, saying %q", want), func() bool {
		return r.logs.has(append(want, "Keeping the last good TLS material")...)
	})
	r.newConnection(t)
	if err := r.list(); err != nil {
		t.Fatalf("a client built before the files went bad: %v", err)
	}
	r.checkServer(t)
	if err := listNodes(r.ctx, r.cfg); err != nil {
		fresh["failed: "+reason(err)]++
	} else {
		fresh["ok"]++
	}
	r.checkServer(t)
	c.restore(t, f.ca.CertPEM(), f.alice)
	r.newConnection(t)
	if err := r.list(); err != nil {
		t.Fatalf("after the good files came back: %v", err)
	}
	r.checkServer(t)
	if st := p.Stats(); st.Rotations != before.Rotations {
		t.Errorf("%d rotations: bad or unchanged files were taken into use", st.Rotations-before.Rotations)
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// TestCANotACA: a CA file whose certificates can verify no server (a client
// certificate put there by mistake, a CA restricted to client
// authentication) is refused at Wrap with the file's name, and after good
// material is a rejected reload that keeps the old CA; a CA file that can
// verify a server (a pinned self-signed serving certificate, which is not a
// CA) is taken. Which is which is decided by client-go alone, through
// crypto/tls, against the strongest servers the bundle's own key can set up:
// one presenting the bundle's certificate itself, and one presenting a
// serving certificate that certificate signed.
func TestCANotACA(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t, withDebounce(10*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for _, tc := range []struct {
		name     string
		bundle   *testserver.KeyPair
		verifies bool // what this test expects client-go to find
	}{
		{"pinned self-signed serving certificate", selfSignedServing(t), true},
		{"client certificate", f.bob, false},
		{"CA for client authentication only", clientAuthCA(t), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verifier := serverVerifiedBy(t, f, tc.bundle)
			if verifies := verifier != ""; verifies != tc.verifies {
				t.Fatalf("client-go alone verifies a server with this bundle: %v, the case expects %v", verifies, tc.verifies)
			}
			host := verifier
			if host == "" {
				host = f.srv.URL()
			}
			dir := filepath.Join(f.dir, strings.ReplaceAll(tc.name, " ", "-"))

			// At Wrap.
			c := writeCredFiles(t, filepath.Join(dir, "wrap"), tc.bundle.CertPEM, f.alice)
			err := p.Wrap(c.config(host))
			switch {
			case tc.verifies && err != nil:
				t.Fatalf("Wrap refused a CA file client-go verifies a server with: %v", err)
			case tc.verifies:
				if err := listNodes(ctx, c.config(host)); err != nil {
					t.Errorf("request to the server the CA file verifies: %v", err)
				}
			case err == nil:
				t.Errorf("Wrap accepted a CA file that verifies no server")
			case !strings.Contains(err.Error(), c.ca) || !strings.Contains(err.Error(), "holds no CA certificate"):
				t.Errorf("Wrap: %q, want an error naming %s and saying it holds no CA certificate", err, c.ca)
			}

			// After good material: the CA file replaced, with a client built
			// before the change, as in TestBadFilesAfterGood.
			good := writeCredFiles(t, filepath.Join(dir, "rotates"), f.ca.CertPEM(), f.alice)
			cfg := good.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			cs, err := kubernetes.NewForConfig(cfg)
			must(t, err)
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Fatal(err)
			}
			before := p.Stats()
			writeAtomic(t, good.ca, tc.bundle.CertPEM)
			waitFor(t, "the reload", func() bool {
				st := p.Stats()
				return st.RotationErrors > before.RotationErrors || st.Rotations > before.Rotations
			})
			after := p.Stats()
			if tc.verifies {
				if after.Rotations != before.Rotations+1 || after.RotationErrors != before.RotationErrors {
					t.Fatalf("%d rotations and %d rejected reloads, want the CA file taken once",
						after.Rotations-before.Rotations, after.RotationErrors-before.RotationErrors)
				}
				// The identity's transport trusts the new CA: a client the
				// pool builds for the files (client-go's own transport for
				// them may still trust the old one, see the README's
				// Copies) reaches the server the new CA verifies.
				vcfg := good.config(verifier)
				hc, err := p.HTTPClientFor(vcfg)
				must(t, err)
				vcs, err := kubernetes.NewForConfigAndClient(vcfg, hc)
				must(t, err)
				if _, err := vcs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
					t.Errorf("request to the server the new CA file verifies, through the pool: %v", err)
				}
				return
			}
			if after.Rotations != before.Rotations || after.RotationErrors != before.RotationErrors+1 {
				t.Fatalf("%d rotations and %d rejected reloads, want the CA file rejected once",
					after.Rotations-before.Rotations, after.RotationErrors-before.RotationErrors)
			}
			// The next handshake still verifies the server with the old CA.
			f.srv.CloseClientConnections()
			waitFor(t, "the pool sees its connection closed", func() bool { return p.Stats().OpenConns == 0 })
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Errorf("request after a rejected CA file: %v", err)
			}
		})
	}
}

// serverVerifiedBy starts the servers a CA bundle holding only kp's
// certificate could verify: one presenting kp itself, and one presenting a
// serving certificate for 127.0.0.1 that kp signed. It returns the URL of the
// first one client-go alone, trusting that bundle, completes a request to
// ("" if none), and logs what crypto/tls said of each.
func serverVerifiedBy(t *testing.T, f *fixture, kp *testserver.KeyPair) string {
	t.Helper()
	key := privateKey(t, kp)
	signed, err := (&testserver.CA{Cert: kp.Cert, Key: key}).IssueServer()
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	verified := ""
	for _, serving := range []struct {
		name string
		kp   *testserver.KeyPair
	}{{"presenting the certificate itself", kp}, {"presenting a certificate it signed", signed}} {
		srv := f.startServer(t, testserver.Options{ServerCert: serving.kp})
		cfg := &rest.Config{Host: srv.URL()}
		cfg.CAData, cfg.CertData, cfg.KeyData = kp.CertPEM, f.alice.CertPEM, f.alice.KeyPEM
		err = listNodes(ctx, cfg)
		t.Logf("client-go alone, server %s: %v", serving.name, err)
		if err == nil && verified == "" {
			verified = srv.URL()
		}
	}
	return verified
}

// clientAuthCA is a CA whose extended key usage allows client
// authentication only: crypto/x509 lets no server chain end in it.
func clientAuthCA(t testing.TB) *testserver.KeyPair {
	t.Helper()
	kp, err := testserver.SelfSigned(testserver.CertSpec{CommonName: "clients-only-ca", CA: true, Client: true})
	must(t, err)
	return kp
}

// selfSignedServing is a serving certificate for 127.0.0.1 that signs
// itself and is not a CA: what a CA file pins for some clusters.
func selfSignedServing(t testing.TB) *testserver.KeyPair {
	t.Helper()
	kp, err := testserver.SelfSigned(testserver.CertSpec{CommonName: "pinned", Server: true,
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	must(t, err)
	return kp
}

// TestCertificateValidity: at Wrap a NotBefore within the clock-skew
// allowance is taken. After good material, a certificate not valid yet is rejected and
// counted once however often the poll sees it, logged with its file and
// dates, and taken once the pool's clock reaches it.
func TestCertificateValidity(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	var ahead atomic.Int64 // how far the pool's clock runs ahead
	logs := &logLines{}
	p := newPool(t, WithPollInterval(50*time.Millisecond), withDebounce(10*time.Millisecond), WithLogger(logs.logger()),
		func(o *options) { o.now = func() time.Time { return time.Now().Add(time.Duration(ahead.Load())) } })

	// A certificate outside its window and a CA bundle whose every
	// certificate expired are badFiles (TestBadFilesAtWrap).
	t.Run("at Wrap", func(t *testing.T) {
		skewed := issueValid(t, f.ca, "a minute ahead", time.Minute, 24*time.Hour)
		c := writeCredFiles(t, filepath.Join(f.dir, "wrap", "skewed"), f.ca.CertPEM(), skewed)
		if err := p.Wrap(c.config(f.srv.URL())); err != nil {
			t.Errorf("a certificate valid a minute from now, within the %v of clock skew allowed: %v", clockSkew, err)
		}
	})

	t.Run("after good material", func(t *testing.T) {
		c := writeCredFiles(t, filepath.Join(f.dir, "rotate"), f.ca.CertPEM(), f.alice)
		cfg := c.config(f.srv.URL())
		must(t, p.Wrap(cfg))
		before := p.Stats()
		kp := issueValid(t, f.ca, "ahead", time.Hour, 25*time.Hour)
		writeAtomic(t, c.key, kp.KeyPEM)
		writeAtomic(t, c.cert, kp.CertPEM)
		waitFor(t, "the reload rejected", func() bool { return p.Stats().RotationErrors > before.RotationErrors })
		time.Sleep(300 * time.Millisecond) // polls of the unchanged files
		if st := p.Stats(); st.RotationErrors != before.RotationErrors+1 || st.Rotations != before.Rotations {
			t.Errorf("after polls of an unchanged certificate not valid yet: %d rejected, %d rotations; want 1 and 0",
				st.RotationErrors-before.RotationErrors, st.Rotations-before.Rotations)
		}
		// The line is logged just after the rejection is counted.
		waitFor(t, "a log line naming the file and the validity dates", func() bool {
			return logs.has(c.cert, "is not valid yet", stamp(kp.Cert.NotBefore), stamp(kp.Cert.NotAfter), "Keeping the last good TLS material")
		})
		ahead.Store(int64(time.Hour))
		waitFor(t, "the certificate taken once valid", func() bool { return p.Stats().Rotations > before.Rotations })
	})
}

// TestCABundleText: a CA file with text around its PEM blocks (comments, a
// trailing "# end of bundle", openssl's description of each certificate, a
// key block, a last block whose END line names another type, hand edits
// that leave the server's CA whole) is accepted as client-go accepts it, at
// Wrap and on rotation; a bundle whose last block is torn, a BEGIN line with
// no whole END line after it, is refused as incomplete, and a bundle whose
// only block does not decode is refused saying so.
func TestCABundleText(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	other, err := testserver.NewCA("other-ca")
	must(t, err)
	ca, otherPEM := string(f.ca.CertPEM()), string(other.CertPEM())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := newPool(t, withDebounce(10*time.Millisecond))
	for i, tc := range []struct{ name, bundle string }{
		{"comment first", "# cluster CA, rotated yearly\n" + ca},
		{"trailing comment", ca + "# end of bundle\n"},
		{"trailing comment without a newline", ca + "# end of bundle"},
		{"text between blocks", otherPEM + "\nthe cluster's CA follows\n\n" + ca + "\n"},
		{"openssl's description before each block", "Certificate:\n    Data:\n        Version: 3 (0x2)\n" + otherPEM + "Certificate:\n    Data:\n" + ca},
		{"a key block beside the CA", ca + string(f.alice.KeyPEM)},
		{"a last block whose END line names another type", ca + strings.Replace(otherPEM, "-----END CERTIFICATE-----", "-----END X509 CRL-----", 1)},
		{"the BEGIN line pasted twice", "-----BEGIN CERTIFICATE-----\n" + ca},
		{"a second CA whose END line has a comment", ca + strings.Replace(otherPEM, "-----END CERTIFICATE-----", "-----END CERTIFICATE----- # rotated 2026", 1)},
		{"a comment naming the BEGIN marker", "# paste each CA below, from its -----BEGIN CERTIFICATE----- line on\n" + ca},
		{"a block without its END, then a whole one", otherPEM[:len(otherPEM)/2] + "\n# comment\n" + ca},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := writeCredFiles(t, filepath.Join(f.dir, "text", strconv.Itoa(i)), []byte(tc.bundle), f.alice)
			if err := listNodes(ctx, c.config(f.srv.URL())); err != nil {
				t.Fatalf("client-go alone refuses the bundle: %v", err)
			}
			if err := p.Wrap(c.config(f.srv.URL())); err != nil {
				t.Fatalf("Wrap: %v", err)
			}
			// On rotation: from a plain bundle to this one.
			r := writeCredFiles(t, filepath.Join(f.dir, "text-rotation", strconv.Itoa(i)), f.ca.CertPEM(), f.alice)
			cfg := r.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			before := p.Stats()
			writeAtomic(t, r.ca, []byte(tc.bundle))
			waitFor(t, "the reload", func() bool {
				st := p.Stats()
				return st.Rotations > before.Rotations || st.RotationErrors > before.RotationErrors
			})
			if st := p.Stats(); st.RotationErrors != before.RotationErrors {
				t.Fatalf("the rotation to the bundle was rejected: %+v", st)
			}
			must(t, listNodes(ctx, cfg))
		})
	}
	t.Run("torn block", func(t *testing.T) {
		for _, bundle := range []string{
			ca + otherPEM[:len(otherPEM)/2],  // cut inside the body
			ca + otherPEM[:len(otherPEM)-10], // cut inside the END line
			ca + "-----BEGIN CERTIFICATE-----",
		} {
			c := writeCredFiles(t, filepath.Join(f.dir, "torn", strconv.Itoa(len(bundle))), []byte(bundle), f.alice)
			err := p.Wrap(c.config(f.srv.URL()))
			if err == nil || !strings.Contains(err.Error(), "incomplete PEM block") || !strings.Contains(err.Error(), c.ca) {
				t.Errorf("Wrap of a torn bundle: %v", err)
			}
		}
	})
	t.Run("a block that does not decode", func(t *testing.T) {
		bundle := strings.Replace(ca, "-----END CERTIFICATE-----", "-----END X509 CRL-----", 1)
		c := writeCredFiles(t, filepath.Join(f.dir, "undecodable"), []byte(bundle), f.alice)
		controlErr := listNodes(ctx, c.config(f.srv.URL()))
		err := p.Wrap(c.config(f.srv.URL()))
		t.Logf("client-go alone: %v; Wrap: %v", controlErr, err)
		if controlErr == nil || err == nil || !strings.Contains(err.Error(), "does not decode") || strings.Contains(err.Error(), "incomplete") {
			t.Errorf("a bundle whose only block does not decode: client-go alone %v, Wrap %v; want both refused, the pool saying it does not decode", controlErr, err)
		}
	})
}

// TestNoStaleRefusal: a config built right after valid files replaced ones
// the pool rejected is built and served, as client-go alone builds and
// serves it: the pool reads the files at that moment instead of returning
// the rejection it read before, however recent. Nothing watches the files,
// so only the pool's reads for new configs see them.
func TestNoStaleRefusal(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	const debounce = 2 * time.Second
	p := newPool(t, withDebounce(debounce), withoutWatching())
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	d.wrapped(t, p, f.srv.URL())
	writeAtomic(t, d.key, f.bob.KeyPEM) // the key stops matching
	time.Sleep(debounce)
	// Read, rejected, read again a debounce later (a rotation might have
	// been half written), rejected.
	if err := p.Wrap(d.config(f.srv.URL())); err == nil {
		t.Fatal("a config built while the key does not match was wrapped: the test's premise is wrong")
	}
	// Now the rejection is older than the debounce and the last read
	// younger.
	time.Sleep(debounce / 4)
	writeAtomic(t, d.cert, f.carol.CertPEM)
	writeAtomic(t, d.key, f.carol.KeyPEM)

	cfg := d.config(f.srv.URL())
	wrapErr := p.Wrap(cfg)
	ctx := context.Background()
	if err := listNodes(ctx, d.config(f.srv.URL())); err != nil {
		t.Fatalf("client-go alone: %v", err)
	}
	if wrapErr != nil {
		t.Fatalf("through the pool, a config built right after the valid pair was written: %v", wrapErr)
	}
	if err := listNodes(ctx, cfg); err != nil {
		t.Fatalf("through the pool: %v", err)
	}
}
