package sharedtransport

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// identitySpec picks, for every field of a rest.Config that can matter, one
// of a few values. Two specs give equal identity keys exactly when their
// identity fields are equal; identityModel says what "equal" means, from the
// documentation (doc.go, DESIGN.md), not from the implementation.
type identitySpec [numSpecFields]uint8

const (
	specCA          = iota // none, CA data, CA+other bundle, CA file, same CA in another file, CA file and data (data wins)
	specCert               // none, alice, bob, alice files, alice cert file + key data (read once), alice key as PKCS#8, alice cert re-issued (same key)
	specExec               // none, exec plugin A, exec plugin B
	specInsecure           // false, true
	specServerName         // "", localhost, example.invalid
	specNextProtos         // nil, [], [h2], [h2 http/1.1], ["h2,http/1.1"]
	specCompression        // on, off
	specProxy              // none, func giving nil, proxy 1, proxy 1 from another func, proxy 2, failing func
	specDial               // none, named d1, named d2, unnamed, another func named d1
	specToken              // none, t1, t2
	specBasic              // none, u1, u2
	specImpersonate        // none, someone
	specUserAgent          // default, custom
	specHost               // 127.0.0.1, localhost, example.invalid
	numSpecFields
)

var specCardinality = [numSpecFields]uint64{6, 7, 3, 2, 3, 5, 2, 6, 5, 3, 3, 2, 2, 3}

func decodeSpec(v uint64) identitySpec {
	var s identitySpec
	for i, n := range specCardinality {
		s[i] = uint8(v % n)
		v /= n
	}
	return s
}

func (s identitySpec) encode() uint64 {
	var v uint64
	for i := numSpecFields - 1; i >= 0; i-- {
		v = v*specCardinality[i] + uint64(s[i])
	}
	return v
}

// mix takes the fields of b selected by mask and the others from a, so the
// fuzzer explores pairs that differ in a few fields.
func mix(a, b identitySpec, mask uint16) identitySpec {
	for i := range a {
		if mask&(1<<i) != 0 {
			a[i] = b[i]
		}
	}
	return a
}

type identityFixture struct {
	port          string
	ca, otherCA   *testserver.CA
	alice, bob    *testserver.KeyPair
	alicePKCS8    *testserver.KeyPair
	aliceReissued *testserver.KeyPair
	caFile1       string
	caFile2       string
	aliceCertFile string
	aliceKeyFile  string
	execA, execB  *clientcmdapi.ExecConfig
	proxy1        *url.URL
	proxy2        *url.URL
	pool          *Pool
	dialNames     sync.Map // *rest.Config -> name for WithDialIdentity
}

func newIdentityFixture(t testing.TB) *identityFixture {
	t.Helper()
	ca, err := testserver.NewCA("ca")
	must(t, err)
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	fx := &identityFixture{port: "6443", ca: ca, otherCA: otherCA}
	if fx.alice, err = ca.IssueClient("alice"); err != nil {
		t.Fatal(err)
	}
	if fx.bob, err = ca.IssueClient("bob"); err != nil {
		t.Fatal(err)
	}
	fx.alicePKCS8 = pkcs8(t, fx.alice)
	fx.aliceReissued = issueForKey(t, ca, "alice", fx.alice)
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		must(t, os.WriteFile(p, b, 0o600))
		return p
	}
	fx.caFile1 = write("ca1.crt", ca.CertPEM())
	fx.caFile2 = write("ca2.crt", ca.CertPEM())
	fx.aliceCertFile = write("alice.crt", fx.alice.CertPEM)
	fx.aliceKeyFile = write("alice.key", fx.alice.KeyPEM)
	fx.execA = writeExecPlugin(t, dir, "exec-a", fx.alice)
	fx.execB = writeExecPlugin(t, dir, "exec-b", fx.bob)
	fx.proxy1, _ = url.Parse("http://127.0.0.1:3128")
	fx.proxy2, _ = url.Parse("http://127.0.0.1:3129")
	fx.pool = New(WithDialIdentity(func(cfg *rest.Config) string {
		name, _ := fx.dialNames.Load(cfg)
		s, _ := name.(string)
		return s
	}))
	t.Cleanup(func() { fx.pool.Close() })
	return fx
}

func (fx *identityFixture) hostPort(s identitySpec) string {
	return [...]string{"127.0.0.1:" + fx.port, "localhost:" + fx.port, "example.invalid:" + fx.port}[s[specHost]]
}

// config builds the rest.Config s describes. Every function value is new,
// as it would be for configs built independently.
func (fx *identityFixture) config(s identitySpec) *rest.Config {
	c := &rest.Config{Host: "https://" + fx.hostPort(s)}
	switch s[specCA] {
	case 1:
		c.CAData = fx.ca.CertPEM()
	case 2:
		c.CAData = append(fx.ca.CertPEM(), fx.otherCA.CertPEM()...)
	case 3:
		c.CAFile = fx.caFile1
	case 4:
		c.CAFile = fx.caFile2
	case 5:
		c.CAFile, c.CAData = fx.caFile2, fx.ca.CertPEM()
	}
	switch s[specCert] {
	case 1:
		c.CertData, c.KeyData = fx.alice.CertPEM, fx.alice.KeyPEM
	case 2:
		c.CertData, c.KeyData = fx.bob.CertPEM, fx.bob.KeyPEM
	case 3:
		c.CertFile, c.KeyFile = fx.aliceCertFile, fx.aliceKeyFile
	case 4:
		c.CertFile, c.KeyData = fx.aliceCertFile, fx.alice.KeyPEM
	case 5:
		c.CertData, c.KeyData = fx.alicePKCS8.CertPEM, fx.alicePKCS8.KeyPEM
	case 6:
		c.CertData, c.KeyData = fx.aliceReissued.CertPEM, fx.aliceReissued.KeyPEM
	}
	switch s[specExec] {
	case 1:
		e := *fx.execA
		c.ExecProvider = &e
	case 2:
		e := *fx.execB
		c.ExecProvider = &e
	}
	c.Insecure = s[specInsecure] == 1
	c.ServerName = [...]string{"", "localhost", "example.invalid"}[s[specServerName]]
	c.NextProtos = [...][]string{nil, {}, {"h2"}, {"h2", "http/1.1"}, {"h2,http/1.1"}}[s[specNextProtos]]
	c.DisableCompression = s[specCompression] == 1
	switch s[specProxy] {
	case 1:
		c.Proxy = func(*http.Request) (*url.URL, error) { return nil, nil }
	case 2:
		c.Proxy = http.ProxyURL(fx.proxy1)
	case 3:
		p := *fx.proxy1
		c.Proxy = func(*http.Request) (*url.URL, error) { return &p, nil }
	case 4:
		c.Proxy = http.ProxyURL(fx.proxy2)
	case 5:
		c.Proxy = func(*http.Request) (*url.URL, error) { return nil, errors.New("no route") }
	}
	if s[specDial] != 0 {
		c.Dial = (&net.Dialer{}).DialContext
		if name := [...]string{"", "d1", "d2", "", "d1"}[s[specDial]]; name != "" {
			fx.dialNames.Store(c, name)
		}
	}
	c.BearerToken = [...]string{"", "t1", "t2"}[s[specToken]]
	if s[specBasic] != 0 {
		c.Username, c.Password = fmt.Sprintf("u%d", s[specBasic]), "secret"
	}
	if s[specImpersonate] == 1 {
		c.Impersonate.UserName = "someone"
	}
	if s[specUserAgent] == 1 {
		c.UserAgent = "custom"
	}
	return c
}

// identityModel is what the documentation promises: the identity of a
// config, as a string, or pass (the pool leaves it to client-go), or an
// error.
func (fx *identityFixture) identityModel(s identitySpec) (key string, pass, wantErr bool) {
	certAuth := s[specCert] != 0
	// client-go's exec authenticator gives no certificate to a config that
	// already authenticates by token, basic auth or certificate.
	exec := s[specExec]
	if s[specToken] != 0 || s[specBasic] != 0 || certAuth {
		exec = 0
	}
	nextProtos := [...]string{"", "", "h2", "h2|http/1.1", "h2,http/1.1"}[s[specNextProtos]]
	hasTLS := s[specCA] != 0 || certAuth || exec != 0 || s[specInsecure] == 1 || s[specServerName] != 0 || nextProtos != ""
	if !hasTLS && s[specDial] == 0 && s[specProxy] == 0 {
		return "", true, false
	}
	if s[specCA] != 0 && s[specInsecure] == 1 {
		return "", false, true
	}
	dial := [...]string{"", "d1", "d2", "", "d1"}[s[specDial]]
	if s[specDial] != 0 && dial == "" {
		return "", true, false // unnamed dialers are not shared
	}
	proxy := ""
	switch s[specProxy] {
	case 1:
		// Direct, which is the same as no Proxy when the environment
		// sends this host direct too.
		req, _ := http.NewRequest(http.MethodGet, "https://"+fx.hostPort(s), nil)
		if env, _ := utilnet.NewProxierWithNoProxyCIDR(http.ProxyFromEnvironment)(req); env != nil {
			proxy = "direct"
		}
	// The route joins the identity; the host does not: a config with Proxy
	// uses the shared transport for its own host only (hook.onlyHost).
	case 2, 3:
		proxy = "proxy1"
	case 4:
		proxy = "proxy2"
	case 5:
		return "", true, false // a failing Proxy is not shared
	}
	return strings.Join([]string{
		[...]string{"", "ca", "ca+other", "ca file 1", "ca file 2", "ca"}[s[specCA]],
		[...]string{"", "alice", "bob", "alice files", "alice", "alice pkcs8", "alice reissued"}[s[specCert]],
		fmt.Sprint("exec ", exec),
		fmt.Sprint("insecure ", s[specInsecure]),
		[...]string{"", "localhost", "example.invalid"}[s[specServerName]],
		nextProtos,
		fmt.Sprint("compression ", s[specCompression]),
		proxy,
		dial,
	}, "/"), false, false
}

// checkIdentityPair asserts that a and b get equal keys exactly when their
// identity fields are equal.
func (fx *identityFixture) checkIdentityPair(t *testing.T, a, b identitySpec) {
	t.Helper()
	var ids [2]*identity
	var keys [2]string
	for i, s := range []identitySpec{a, b} {
		cfg := fx.config(s)
		sh, share, err := sharingFor(cfg, declaration{}, fx.pool.opts.dialIdentity, false)
		id := sh.id
		if !share {
			id = nil
		}
		fx.dialNames.Delete(cfg)
		key, pass, wantErr := fx.identityModel(s)
		if (err != nil) != wantErr {
			t.Fatalf("spec %v: identityFor error %v, want error: %v", s, err, wantErr)
		}
		if err == nil && (id == nil) != pass {
			t.Fatalf("spec %v: passed through: %v, want %v", s, id == nil, pass)
		}
		ids[i], keys[i] = id, key
	}
	if ids[0] == nil || ids[1] == nil {
		return
	}
	if got, want := ids[0].key == ids[1].key, keys[0] == keys[1]; got != want {
		t.Fatalf("specs %v and %v: same key %v, want %v (identities %q and %q)", a, b, got, want, keys[0], keys[1])
	}
}

// identitySeeds are pairs that differ in one field, from a config with a CA
// and a client certificate.
func identitySeeds() [][3]uint64 {
	base := identitySpec{}
	base[specCA], base[specCert] = 1, 1
	var seeds [][3]uint64
	for field := range numSpecFields {
		for v := range specCardinality[field] {
			other := base
			other[field] = uint8(v)
			seeds = append(seeds, [3]uint64{base.encode(), other.encode(), 1 << field})
		}
	}
	return seeds
}

// FuzzIdentity: identity keys are equal if and only if the identity fields
// are equal. Run with go test -fuzz FuzzIdentity; the seeds run in every
// go test.
func FuzzIdentity(f *testing.F) {
	for _, s := range identitySeeds() {
		f.Add(s[0], s[1], uint16(s[2]))
	}
	fx := newIdentityFixture(f)
	f.Fuzz(func(t *testing.T, a, b uint64, mask uint16) {
		sa := decodeSpec(a)
		fx.checkIdentityPair(t, sa, mix(sa, decodeSpec(b), mask))
	})
}

// TestIdentityProperty runs the FuzzIdentity property over random pairs, so
// that a plain go test covers more than the seeds.
func TestIdentityProperty(t *testing.T) {
	fx := newIdentityFixture(t)
	n := 20000
	if testing.Short() {
		n = 2000
	}
	r := rand.New(rand.NewPCG(1, 2))
	equal := 0
	for range n {
		a := decodeSpec(r.Uint64())
		b := mix(a, decodeSpec(r.Uint64()), uint16(r.Uint32())&uint16(r.Uint32())) // about a quarter of the fields differ
		fx.checkIdentityPair(t, a, b)
		if ka, pa, ea := fx.identityModel(a); !pa && !ea {
			if kb, pb, eb := fx.identityModel(b); !pb && !eb && ka == kb {
				equal++
			}
		}
	}
	t.Logf("%d pairs, %d of them the same identity", n, equal)
	if equal < n/50 {
		t.Errorf("only %d pairs share an identity: the property is barely tested", equal)
	}
}

// FuzzCABundle: the CA loader never panics, and accepts only bundles
// client-go can use, whose last BEGIN line has its END line.
func FuzzCABundle(f *testing.F) {
	ca, err := testserver.NewCA("ca")
	if err != nil {
		f.Fatal(err)
	}
	other, err := testserver.NewCA("other")
	if err != nil {
		f.Fatal(err)
	}
	leaf, err := ca.IssueClient("leaf")
	if err != nil {
		f.Fatal(err)
	}
	good := ca.CertPEM()
	for _, seed := range [][]byte{
		good,
		append(append([]byte{}, good...), other.CertPEM()...),
		good[:len(good)/2],
		append(append([]byte{}, good...), other.CertPEM()[:40]...),
		leaf.KeyPEM,
		append(append([]byte{}, good...), leaf.KeyPEM...),
		leaf.CertPEM,
		[]byte(""),
		[]byte("  \n\t"),
		[]byte("not a certificate"),
		[]byte("# comment\n" + string(good)),
		[]byte(string(good) + "\n# trailing comment\n"),
		[]byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"),
		[]byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"),
	} {
		f.Add(seed)
	}
	p := New()
	f.Fuzz(func(t *testing.T, b []byte) {
		err := checkCABundle(b, time.Now())
		if err == nil {
			// What client-go accepts, and the last block not torn: the
			// last BEGIN line has an END line after it.
			if !x509.NewCertPool().AppendCertsFromPEM(b) {
				t.Fatal("accepted a bundle crypto/x509 cannot use")
			}
			if i := bytes.LastIndex(b, []byte("\n-----BEGIN")); i >= 0 && !bytes.Contains(b[i:], []byte("\n-----END")) {
				t.Fatalf("accepted a last BEGIN line with no END line after it: %q", b[i:])
			}
		}
		// Through the whole loader, as inline CA data.
		if _, lerr := loadMaterial(&sources{caData: b}, p.opts.now); (lerr == nil) != (err == nil || len(b) == 0) {
			t.Fatalf("loadMaterial: %v, checkCABundle: %v", lerr, err)
		}
	})
}

// FuzzKeyPair: the certificate and key loader never panics, accepts exactly
// the pairs crypto/tls accepts, and never puts key bytes in its errors.
func FuzzKeyPair(f *testing.F) {
	ca, err := testserver.NewCA("ca")
	if err != nil {
		f.Fatal(err)
	}
	alice, err := ca.IssueClient("alice")
	if err != nil {
		f.Fatal(err)
	}
	bob, err := ca.IssueClient("bob")
	if err != nil {
		f.Fatal(err)
	}
	alicePKCS8 := pkcs8(f, alice)
	for _, seed := range [][2][]byte{
		{alice.CertPEM, alice.KeyPEM},
		{alicePKCS8.CertPEM, alicePKCS8.KeyPEM},
		{alice.CertPEM, bob.KeyPEM},
		{alice.KeyPEM, alice.CertPEM},
		{alice.CertPEM[:len(alice.CertPEM)/2], alice.KeyPEM},
		{alice.CertPEM, alice.KeyPEM[:len(alice.KeyPEM)/2]},
		{append(append([]byte{}, alice.CertPEM...), alice.KeyPEM...), append(append([]byte{}, alice.CertPEM...), alice.KeyPEM...)},
		{alice.CertPEM, nil},
		{nil, alice.KeyPEM},
		{nil, nil},
		{ca.CertPEM(), alice.KeyPEM},
		{[]byte("garbage"), []byte("garbage")},
	} {
		f.Add(seed[0], seed[1])
	}
	p := New()
	f.Fuzz(func(t *testing.T, cert, key []byte) {
		now := time.Now()
		_, err := loadMaterial(&sources{certData: cert, keyData: key}, p.opts.now)
		pair, tlsErr := tls.X509KeyPair(cert, key)
		// crypto/tls accepts the pair, and its certificate is valid now.
		valid := tlsErr == nil && !now.After(pair.Leaf.NotAfter) && !now.Add(clockSkew).Before(pair.Leaf.NotBefore)
		want := valid || (len(cert) == 0 && len(key) == 0)
		if (err == nil) != want {
			t.Fatalf("loader error %v, crypto/tls error %v", err, tlsErr)
		}
		if err != nil {
			for _, line := range strings.Split(string(key), "\n") {
				if line = strings.TrimSpace(line); len(line) >= 16 && !strings.HasPrefix(line, "-----") && strings.Contains(err.Error(), line) {
					t.Fatalf("error %q repeats key input %q", err, line)
				}
			}
		}
	})
}
