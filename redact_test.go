package sharedtransport

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/sharedtransport/sharedtransport/internal/klogcapture"
	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestRedactHost: hosts as client-go reads them, with and without a scheme,
// print as scheme://host; what does not parse prints the placeholder.
func TestRedactHost(t *testing.T) {
	for in, want := range map[string]string{
		"":                                    "",
		"https://127.0.0.1:6443":              "https://127.0.0.1:6443",
		"127.0.0.1:6443":                      "https://127.0.0.1:6443",
		"admin:pw@127.0.0.1:6443":             "https://127.0.0.1:6443",
		"https://admin:pw@127.0.0.1:6443/":    "https://127.0.0.1:6443",
		"http://user:p/w@proxy:3128":          unparsableURL,
		"http://user:p%zz@proxy:3128":         unparsableURL,
		"http://user:p w@proxy:3128":          unparsableURL,
		`http://user:p"w@proxy:3128`:          unparsableURL,
		"http://user:p%20w@proxy:3128":        "http://proxy:3128",
		"http://u:pw:#@proxy:3128":            unparsableURL,
		"http://token@proxy:3128":             "http://proxy:3128",
		"https://[::1]:6443":                  "https://[::1]:6443",
		"https://admin:pw@127.0.0.1:6443?q#f": "https://127.0.0.1:6443",
	} {
		if got := redactHost(in); got != want {
			t.Errorf("redactHost(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzRedaction: with klog at -v=10, no password of a config's Host or of
// its proxy's URL, whatever bytes it holds, appears in what the pool logs,
// in the errors of Wrap, TransportFor and client construction, in Stats or
// in Identities: neither the password nor its escaped form.
func FuzzRedaction(f *testing.F) {
	for _, pw := range []string{"/", "a/b", " ", "a b\tc\n", `"`, `a"b`, "@", "a@b:c", "%zz", "%41", "?#", ":", "ü", "\x00", ""} {
		for kind := range uint8(6) {
			f.Add(pw, kind)
		}
	}
	f.Fuzz(func(t *testing.T, fuzzed string, kind uint8) {
		password := "pw" + randomSecret(t, "") + fuzzed
		logs := captureKlog(t, 10)
		texts := redactionRun(t, password, kind)
		klog.Flush()
		escaped := strings.TrimPrefix(url.UserPassword("", password).String(), ":")
		marker := password[:18]
		for _, text := range append(texts, logs.String()) {
			for _, secret := range []string{password, escaped, marker} {
				if strings.Contains(text, secret) {
					t.Fatalf("kind %d: %q holds the password %q:\n%s", kind, secret, password, text)
				}
			}
		}
	})
}

// redactionRun builds configs whose Host or proxy URL holds password, as
// kind says, through Wrap, TransportFor and WrapConfigFn, and returns every
// error and printed value it saw.
func redactionRun(t *testing.T, password string, kind uint8) []string {
	p := newPool(t)
	raw := "admin:" + password + "@127.0.0.1:1"
	escaped := url.UserPassword("admin", password).String() + "@127.0.0.1:1"
	cfg := &rest.Config{}
	cfg.Insecure = true
	switch kind % 6 {
	case 0:
		cfg.Host = "https://" + raw
	case 1:
		cfg.Host = raw // no scheme: client-go reads it as https://
	case 2:
		cfg.Host = escaped
	case 3: // a proxy URL with the password
		cfg.Host = "https://127.0.0.1:1"
		u := &url.URL{Scheme: "http", User: url.UserPassword("proxyuser", password), Host: "127.0.0.1:2"}
		cfg.Proxy = http.ProxyURL(u)
	case 4: // a Proxy function failing to parse its URL
		cfg.Host = "https://127.0.0.1:1"
		cfg.Proxy = func(*http.Request) (*url.URL, error) {
			return url.Parse("http://proxyuser:" + password + "@127.0.0.1:2")
		}
	case 5: // a Proxy function quoting its URL in its own words
		cfg.Host = "https://127.0.0.1:1"
		cfg.Proxy = func(*http.Request) (*url.URL, error) {
			return nil, fmt.Errorf("proxy http://proxyuser:%s@127.0.0.1:2 refused", password)
		}
	}
	var texts []string
	note := func(what string, v any) { texts = append(texts, fmt.Sprintf("%s: %v %+v", what, v, v)) }
	wrapped := rest.CopyConfig(cfg)
	if err := p.Wrap(wrapped); err != nil {
		note("Wrap", err)
	} else if _, err := kubernetes.NewForConfig(wrapped); err != nil {
		note("client", err)
	}
	if _, err := p.TransportFor(rest.CopyConfig(cfg)); err != nil {
		note("TransportFor", err)
	}
	p.WrapConfigFn(rest.CopyConfig(cfg))
	note("Stats", p.Stats())
	note("Identities", p.Identities())
	return texts
}

// TestRedactError: a Proxy function's error prints its *url.Error's URL
// redacted, and nothing else of its text.
func TestRedactError(t *testing.T) {
	_, parseErr := url.Parse("http://u:se/cret@proxy:3128")
	for _, c := range []struct {
		err  error
		want string
	}{
		{&url.Error{Op: "Get", URL: "http://u:secret@proxy:3128", Err: errors.New("refused secret")}, "Get http://proxy:3128: an error whose text"},
		{parseErr, "parse " + unparsableURL + ": an error whose text"},
		{fmt.Errorf("wrapped: %w", &url.Error{Op: "Get", URL: "u:secret@proxy:1", Err: errors.New("x")}), "Get https://proxy:1: "},
		{errors.New("proxy http://u:secret@proxy refused"), "an error whose text is not shown"},
	} {
		got := redactError(c.err)
		if !strings.HasPrefix(got, c.want) || strings.Contains(got, "secret") || strings.Contains(got, "cret") {
			t.Errorf("redactError(%v) = %q, want it to begin %q and hold no secret", c.err, got, c.want)
		}
	}
}

// captureKlog sends klog's output, at verbosity v, to the returned buffer
// until the test ends.
func captureKlog(t *testing.T, v int) *klogcapture.Buffer { return klogcapture.Start(t, v) }

// secretForms returns the ways a PEM private key could show up in text: the
// PEM, each line of its base64 body, the whole body (base64 of the DER), the
// base64 of the PEM (kubeconfig *-data fields), the DER in hex and raw.
func secretForms(t testing.TB, keyPEM []byte) []string {
	t.Helper()
	block, _ := pem.Decode(keyPEM)
	if block == nil {
		t.Fatal("not PEM")
	}
	forms := []string{
		string(keyPEM),
		base64.StdEncoding.EncodeToString(block.Bytes),
		base64.StdEncoding.EncodeToString(keyPEM),
		hex.EncodeToString(block.Bytes),
		hex.EncodeToString(keyPEM),
		string(block.Bytes),
		strings.Trim(fmt.Sprint(block.Bytes), "[]"), // %v of a []byte
		strings.Trim(fmt.Sprint(keyPEM), "[]"),
	}
	for _, line := range strings.Split(string(keyPEM), "\n") {
		if len(line) >= 20 && !strings.HasPrefix(line, "-----") {
			forms = append(forms, line)
		}
	}
	return forms
}

func randomSecret(t testing.TB, prefix string) string {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return prefix + hex.EncodeToString(b)
}

// TestSecretsStaySecret: with klog at -v=10, nothing the library or
// client-go logs, no error, no identity String() and no Stats output
// contains private key bytes or credentials, through Wrap, requests, a
// rotation through bad files to good ones, Stats and errors.
func TestSecretsStaySecret(t *testing.T) {
	logs := captureKlog(t, 10)
	token, password := randomSecret(t, "token-"), randomSecret(t, "password-")
	f := newFixture(t, testserver.Options{Tokens: map[string]string{token: "token-user"}})
	execKP, err := f.ca.IssueClient("exec-user")
	must(t, err)
	var secrets []string
	for _, kp := range []*testserver.KeyPair{f.alice, f.bob, f.carol, execKP} {
		secrets = append(secrets, secretForms(t, kp.KeyPEM)...)
	}
	proxyPassword, proxyCred := randomSecret(t, "proxy-password-"), randomSecret(t, "proxy-cred-")
	secrets = append(secrets, token, password, proxyPassword, proxyCred)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := &secretsScan{f: f, p: newPool(t, WithIdleTimeout(0), withDebounce(10*time.Millisecond)), ctx: ctx}

	// Wrap and requests: certificate files, a token, basic auth, an exec
	// plugin's certificate.
	paths := f.kubeconfig(t, "alice", f.alice)
	fileCfg := &rest.Config{Host: f.srv.URL(), BearerToken: token}
	fileCfg.CAFile, fileCfg.CertFile, fileCfg.KeyFile = paths.CA, paths.Cert, paths.Key
	basicCfg := f.srv.RestConfig(f.bob)
	basicCfg.Username, basicCfg.Password = "someone", password
	execCfg := f.srv.RestConfig(nil)
	execCfg.ExecProvider = writeExecPlugin(t, f.dir, "exec", execKP)
	for _, cfg := range []*rest.Config{fileCfg, basicCfg, execCfg} {
		must(t, sc.p.Wrap(cfg))
		must(t, listNodes(ctx, cfg))
	}
	proxied := sc.proxied(t, proxyPassword, proxyCred)
	sc.rotations(t, paths, fileCfg)
	sc.badMaterial(t, basicCfg, token)
	sc.printed(t)
	runtime.KeepAlive([]any{fileCfg, basicCfg, execCfg, proxied}) // their identities were printed above
	must(t, sc.p.Close())
	sc.note("after Close", listNodes(ctx, fileCfg))
	klog.Flush()
	checkNoSecrets(t, logs.String(), sc.texts, secrets, f.alice.KeyPEM)
}

// secretsScan is TestSecretsStaySecret's pool and what it saw besides the
// logs.
type secretsScan struct {
	f     *fixture
	p     *Pool
	ctx   context.Context
	texts []string // errors and strings the test saw
}

func (sc *secretsScan) note(what string, v any) {
	if v != nil {
		sc.texts = append(sc.texts, fmt.Sprintf("%s: %v", what, v))
	}
}

// proxied gives the pool a config with a proxy with a password in its URL
// and a CONNECT header from a Karmada-style wrapper, and returns the client
// built; the proxy is not there, so its request fails.
func (sc *secretsScan) proxied(t *testing.T, proxyPassword, proxyCred string) kubernetes.Interface {
	t.Helper()
	proxyCfg := sc.f.srv.RestConfig(sc.f.alice)
	proxyURL, _ := url.Parse("http://proxyuser:" + proxyPassword + "@127.0.0.1:1")
	proxyCfg.Proxy = http.ProxyURL(proxyURL)
	header := http.Header{"Proxy-Authorization": {"Basic " + proxyCred}}
	proxyCfg.WrapTransport = memberproxy.ProxyHeaderWrapper(nil, header)
	cs, err := declaredClientset(sc.p, proxyCfg, WithProxyConnectHeader(header))
	must(t, err)
	_, err = cs.CoreV1().Nodes().List(sc.ctx, metav1.ListOptions{})
	sc.note("request through a proxy that is not there", err)
	return cs
}

// rotations writes bad files over fileCfg's (rejected and logged), then
// good ones (taken).
func (sc *secretsScan) rotations(t *testing.T, paths testserver.Paths, fileCfg *rest.Config) {
	t.Helper()
	f, p := sc.f, sc.p
	rotateTo := func(what string, cert, key []byte, done func(Stats) bool) {
		t.Helper()
		if cert != nil {
			must(t, os.WriteFile(paths.Cert, cert, 0o600))
		}
		if key != nil {
			must(t, os.WriteFile(paths.Key, key, 0o600))
		}
		waitFor(t, what, func() bool { return done(p.Stats()) })
		sc.note(what+": request", listNodes(sc.ctx, fileCfg))
	}
	errorsAfter := func(n uint64) func(Stats) bool { return func(s Stats) bool { return s.RotationErrors > n } }
	rotateTo("torn key", nil, f.alice.KeyPEM[:len(f.alice.KeyPEM)/2], errorsAfter(p.Stats().RotationErrors))
	rotateTo("key of another certificate", nil, f.bob.KeyPEM, errorsAfter(p.Stats().RotationErrors))
	rotateTo("key where the certificate belongs", f.alice.KeyPEM, f.alice.KeyPEM, errorsAfter(p.Stats().RotationErrors))
	rotateTo("empty key", f.alice.CertPEM, []byte{}, errorsAfter(p.Stats().RotationErrors))
	rotateTo("good files", f.carol.CertPEM, f.carol.KeyPEM, func(s Stats) bool { return s.Rotations > 0 })
}

// badMaterial: Wrap of bad inline material and bad files, requests that fail,
// the adapter's logged error, an identity released by GC.
func (sc *secretsScan) badMaterial(t *testing.T, basicCfg *rest.Config, token string) {
	t.Helper()
	f, p := sc.f, sc.p
	for _, c := range []*rest.Config{
		{Host: f.srv.URL(), TLSClientConfig: rest.TLSClientConfig{CertData: f.alice.CertPEM, KeyData: f.bob.KeyPEM}},
		{Host: f.srv.URL(), TLSClientConfig: rest.TLSClientConfig{CertData: f.alice.KeyPEM, KeyData: f.alice.KeyPEM}},
		{Host: f.srv.URL(), TLSClientConfig: rest.TLSClientConfig{CAData: f.alice.KeyPEM}},
		{Host: f.srv.URL(), TLSClientConfig: rest.TLSClientConfig{CertData: f.alice.CertPEM, KeyData: f.alice.KeyPEM[:40]}},
	} {
		err := p.Wrap(c)
		if err == nil {
			t.Errorf("Wrap of bad material succeeded")
		}
		sc.note("Wrap", err)
		p.WrapConfigFn(c)
	}
	wrong := rest.CopyConfig(basicCfg)
	wrong.CAData = f.alice.CertPEM // verifies nothing: the handshake fails
	sc.note("request with a wrong CA", listNodes(sc.ctx, wrong))
	func() {
		throwaway := f.srv.RestConfig(f.carol)
		throwaway.BearerToken = token
		must(t, p.Wrap(throwaway))
	}()
	waitFor(t, "an identity released", func() bool { runtime.GC(); return p.Stats().Identities <= 4 })
}

// printed notes the keys' String() and the pool's Stats and Identities.
func (sc *secretsScan) printed(t *testing.T) {
	t.Helper()
	p := sc.p
	p.reg.mu.Lock()
	for k, h := range p.reg.entries {
		sc.note("key String", k.String())
		sc.note("key %v", fmt.Sprintf("%v %+v %s", k, k, k))
		sc.note("entry key", h.e.id.key)
	}
	p.reg.mu.Unlock()
	sc.note("Stats", fmt.Sprintf("%+v %#v", p.Stats(), p.Stats()))
	identities := fmt.Sprintf("%+v %#v", p.Identities(), p.Identities())
	if !strings.Contains(identities, "Proxy:http://127.0.0.1:1 ") || !strings.Contains(identities, "LastError:sharedtransport: ") {
		t.Errorf("Identities shows neither the redacted proxy nor the last reload error: the scan does not see what it should:\n%s", identities)
	}
	sc.note("Identities", identities)
}

// checkNoSecrets scans the logs and texts for secrets and PEM blocks, after
// checking that the scan sees what it should (the logs' expected lines, a
// printed key).
func checkNoSecrets(t *testing.T, logText string, texts, secrets []string, keyPEM []byte) {
	t.Helper()
	for _, want := range []string{"Keeping the last good TLS material", "Rotated TLS material", "Released an identity", "Authorization: Bearer <masked>", "Response Body"} {
		if !strings.Contains(logText, want) {
			t.Errorf("the logs lack %q: the capture does not see what it should", want)
		}
	}
	// The scan is live: printing an identity's key data is caught.
	if leaky := fmt.Sprintf("%+v", identity{src: sources{keyData: keyPEM}}); !containsAny(leaky, secrets) {
		t.Errorf("the scan misses a printed key")
	}
	lines := strings.Split(logText, "\n")
	t.Logf("scanned %d log lines (%d bytes) and %d errors and strings for %d secret forms", len(lines), len(logText), len(texts), len(secrets))
	for _, s := range secrets {
		for _, line := range lines {
			if strings.Contains(line, s) {
				t.Errorf("a log line holds a secret: %.300s", line)
			}
		}
		for _, text := range texts {
			if strings.Contains(text, s) {
				t.Errorf("%.300s holds a secret", text)
			}
		}
	}
	for _, line := range append(lines, texts...) {
		if strings.Contains(line, "-----BEGIN") { // naming a block type is fine; quoting a block is not
			t.Errorf("%.300s quotes PEM data", line)
		}
	}
}

// mustNoSecret fails t when text, the pool's output named by what, holds any
// of secrets.
func mustNoSecret(t testing.TB, what, text string, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, s) {
			t.Errorf("%s holds a secret, %q:\n%s", what, s, text)
		}
	}
}

// mustNoSecretLogged fails t when a line logs captured holds any of secrets.
func mustNoSecretLogged(t testing.TB, logs *klogcapture.Buffer, secrets ...string) {
	t.Helper()
	klog.Flush()
	mustNoSecret(t, "the log", logs.String(), secrets...)
}

func containsAny(text string, secrets []string) bool {
	for _, s := range secrets {
		if strings.Contains(text, s) {
			return true
		}
	}
	return false
}

// withDebounce shortens how long file events settle before a reload.
func withDebounce(d time.Duration) Option {
	return func(o *options) { o.debounce = d }
}

// TestIdentityNamesResistGuessing: the name an identity is logged with lets
// no one holding the log test guesses offline. A second process (another
// run of this test binary, as an attacker's would be) computes the names of
// configs with every password of a dictionary; none may match the name this
// process printed.
func TestIdentityNamesResistGuessing(t *testing.T) {
	dictionary := []string{"password", "letmein", "hunter2", "secret", "admin", "kubernetes"}
	p := newPool(t)
	nameFor := func(password string) string {
		proxy, _ := url.Parse("http://proxyuser:" + password + "@127.0.0.1:3128")
		cfg := &rest.Config{Host: "https://127.0.0.1:6443", Proxy: http.ProxyURL(proxy)}
		cfg.Insecure = true
		sh, share, err := sharingFor(cfg, declaration{}, nil, false)
		id := sh.id
		if err != nil || !share {
			t.Fatalf("identityFor: %v, share %v", err, share)
		}
		return p.nameOf(id.key)
	}
	if os.Getenv("SHAREDTRANSPORT_GUESS") == "1" {
		for _, word := range dictionary {
			fmt.Printf("guess %s %s\n", word, nameFor(word))
		}
		return
	}
	printed := nameFor("hunter2")
	if again := nameFor("hunter2"); again != printed {
		t.Fatalf("the name is not stable in one process: %s, then %s", printed, again)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestIdentityNamesResistGuessing$", "-test.count=1")
	cmd.Env = append(os.Environ(), "SHAREDTRANSPORT_GUESS=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the guessing process: %v\n%s", err, out)
	}
	guesses := 0
	for _, line := range strings.Split(string(out), "\n") {
		var word, name string
		if n, _ := fmt.Sscanf(line, "guess %s %s", &word, &name); n != 2 {
			continue
		}
		guesses++
		if name == printed {
			t.Errorf("another process recovered the proxy password %q from the printed name %s", word, printed)
		}
	}
	if guesses != len(dictionary) {
		t.Fatalf("the guessing process made %d guesses, want %d:\n%s", guesses, len(dictionary), out)
	}
}

// TestHostPasswordRedacted: a password in a Host that does not parse never
// reaches an error or a log line, and a bad Host is reported as a bad Host,
// with Proxy set or not.
func TestHostPasswordRedacted(t *testing.T) {
	logs := captureKlog(t, 10)
	const password = "S3cr%et-pw"
	p := newPool(t)
	for _, withProxy := range []bool{false, true} {
		cfg := &rest.Config{Host: "https://admin:" + password + "@127.0.0.1:6443"}
		cfg.Insecure = true
		give := wrapFn(p)
		if withProxy {
			cfg.Proxy = nilProxy
			give = func(cfg *rest.Config) error { _, err := p.TransportFor(cfg); return err } // Wrap passes it through
		}
		err := give(cfg)
		if err == nil {
			t.Fatalf("Proxy %v: Wrap accepted a Host that does not parse", withProxy)
		}
		if !strings.Contains(err.Error(), "not a valid URL") {
			t.Errorf("Proxy %v: Wrap's error %q does not say the Host is bad", withProxy, err)
		}
		// A Host that does not parse is not printed at all.
		if !strings.Contains(err.Error(), strconv.Quote(unparsableURL)) {
			t.Errorf("Proxy %v: Wrap's error %q does not stand for the host with %q", withProxy, err, unparsableURL)
		}
		mustNoSecret(t, fmt.Sprintf("Proxy %v: Wrap's error", withProxy), err.Error(), "S3cr")
		p.WrapConfigFn(cfg)
	}
	mustNoSecretLogged(t, logs, "S3cr")
	if !strings.Contains(logs.String(), "not a valid URL") {
		t.Errorf("WrapConfigFn logged nothing about the bad Host")
	}
}

// FuzzBadHostUnprinted: a Host client-go cannot read is one redactHost does
// not print either, so hostRequest's error, which names no host, loses
// nothing by it.
func FuzzBadHostUnprinted(f *testing.F) {
	for _, h := range []string{"https://u:pw@h:port", "h/path", "u:p@h/x", "%zz", "https://[::1", "http://h:1/ok", "h:6443", " ", ":"} {
		f.Add(h)
	}
	f.Fuzz(func(t *testing.T, host string) {
		if host == "" {
			return // client-go reads it as localhost
		}
		if _, _, err := rest.DefaultServerUrlFor(&rest.Config{Host: host}); err == nil {
			return
		}
		if got := redactHost(host); got != unparsableURL {
			t.Errorf("client-go cannot read host %q, but redactHost prints %q", host, got)
		}
	})
}
