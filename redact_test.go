package sharedtransport

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
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
