package sharedtransport

import (
	"context"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// testClock is a pool's clock that a test moves ahead of the real one.
type testClock struct{ ahead atomic.Int64 }

func (c *testClock) now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

func (c *testClock) advance(d time.Duration) { c.ahead.Add(int64(d)) }

func (c *testClock) option() Option { return func(o *options) { o.now = c.now } }

// withoutWatching turns the pool's file events and polls off: the files are
// read only when a config is built.
func withoutWatching() Option {
	return func(o *options) { o.disableNotify, o.pollInterval = true, 0 }
}

// newConfigResult is what a config built through a pool got: the step that
// failed ("" when its request succeeded), why, and whether its client
// passed through to client-go's transport.
type newConfigResult struct {
	failed, reason string
	passThrough    bool
	cs             kubernetes.Interface
	cfg            *rest.Config
}

// buildAndList builds a config naming d's files through p (by Wrap, or by
// HTTPClientFor) and lists nodes with a client of it.
func buildAndList(ctx context.Context, p *Pool, via string, d *certDir, host string) newConfigResult {
	cfg := d.config(host)
	r := newConfigResult{cfg: cfg}
	pass := p.Stats().PassThrough
	var err error
	switch via {
	case "Wrap":
		if err = p.Wrap(cfg); err != nil {
			r.failed, r.reason = "Wrap", err.Error()
			return r
		}
		r.cs, err = kubernetes.NewForConfig(cfg)
	default:
		c, herr := p.HTTPClientFor(cfg)
		if herr != nil {
			r.failed, r.reason = "TransportFor", herr.Error()
			return r
		}
		r.cs, err = kubernetes.NewForConfigAndClient(cfg, c)
	}
	if err != nil {
		r.failed, r.reason = "client", reason(err)
		return r
	}
	if _, err := r.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		r.failed, r.reason = "request", reason(err)
	}
	r.passThrough = p.Stats().PassThrough > pass
	return r
}

// TestNewConfigGetsFilesNow: after a good config of an identity, each change
// of its files below makes a config built now fail as it fails through a
// fresh pool, and as client-go alone fails for those files, through Wrap and
// through TransportFor; clients built before keep the last good material
// when the change is a rejection, and Identities reports it.
func TestNewConfigGetsFilesNow(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	otherCA, err := testserver.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	writeCA := func(b []byte) func(testing.TB, *certDir) {
		return func(t testing.TB, d *certDir) {
			t.Helper()
			writeAtomic(t, d.ca, b)
		}
	}
	cases := []struct {
		name    string
		apply   func(testing.TB, *certDir)
		file    func(*certDir) string // the file the refusal names; nil: the material is taken
		reason  string
		control string // what client-go alone says
	}{
		{"CA file deleted", remove(func(d *certDir) string { return d.ca }), func(d *certDir) string { return d.ca }, "no such file or directory", "no such file or directory"},
		{"CA file emptied", writeCA(nil), func(d *certDir) string { return d.ca }, "is empty", "unknown authority"},
		{"expired CA written", writeCA(expiredCopy(t, f.ca)), func(d *certDir) string { return d.ca }, "every one has expired", "expired"},
		{"another CA written", writeCA(otherCA.CertPEM()), nil, "unknown authority", "unknown authority"},
		{"client certificate and key deleted", func(t testing.TB, d *certDir) {
			remove(func(d *certDir) string { return d.cert })(t, d)
			remove(func(d *certDir) string { return d.key })(t, d)
		}, func(d *certDir) string { return d.cert }, "no such file or directory", "no such file or directory"},
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, via := range []string{"Wrap", "TransportFor"} {
		for i, c := range cases {
			t.Run(via+"/"+c.name, func(t *testing.T) {
				clock := &testClock{}
				p := newPool(t, withoutWatching(), clock.option())
				d := writeCredFiles(t, filepath.Join(f.dir, via, string(rune('a'+i))), f.ca.CertPEM(), f.alice)
				first := buildAndList(ctx, p, via, d, f.srv.URL())
				if first.failed != "" {
					t.Fatalf("the first config: %s: %s", first.failed, first.reason)
				}
				c.apply(t, d)
				clock.advance(time.Second) // longer than the debounce since the files were read

				got := buildAndList(ctx, p, via, d, f.srv.URL())
				fresh := buildAndList(ctx, newPool(t), via, d, f.srv.URL())
				control := writeCredFiles(t, filepath.Join(f.dir, via+"-control", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
				c.apply(t, control)
				alone := listNodes(ctx, control.config(f.srv.URL()))
				t.Logf("pool: %s %q; fresh pool: %s %q; client-go alone: %v", got.failed, got.reason, fresh.failed, fresh.reason, alone)

				if got.failed != fresh.failed || withoutNow(got.reason) != withoutNow(fresh.reason) || got.passThrough != fresh.passThrough {
					t.Errorf("a config built now got %+v, through a fresh pool %+v", got, fresh)
				}
				if alone == nil || !strings.Contains(alone.Error(), c.control) {
					t.Errorf("client-go alone: %v, want an error saying %q", alone, c.control)
				}
				if via == "TransportFor" && !strings.Contains(got.reason, c.reason) {
					t.Errorf("the config built now: %s %q, want it to fail saying %q", got.failed, got.reason, c.reason)
				}
				if c.file == nil {
					return
				}
				if got.failed != via || !strings.Contains(got.reason, c.file(d)) || !strings.Contains(got.reason, c.reason) {
					t.Errorf("the config built now: %s %q, want %s to fail naming %s and saying %q", got.failed, got.reason, via, c.file(d), c.reason)
				}
				infos := p.Identities()
				if len(infos) != 1 || !strings.Contains(infos[0].FilesError, c.reason) {
					t.Errorf("Identities: %+v, want the files' error", infos)
				}
				// The first config's client keeps the last good material,
				// on a new connection too.
				f.srv.CloseClientConnections()
				if _, err := first.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
					t.Errorf("a client built before the change: %v", err)
				}
				runtime.KeepAlive(first.cfg)
			})
		}
	}
}

// expiredCopy is ca's certificate (its subject, its key) with a validity
// that ended a day ago.
func expiredCopy(t testing.TB, ca *testserver.CA) []byte {
	t.Helper()
	kp, err := testserver.SelfSigned(testserver.CertSpec{CommonName: ca.Cert.Subject.CommonName, CA: true, Key: ca.Key,
		NotBefore: time.Now().Add(-365 * 24 * time.Hour), NotAfter: time.Now().Add(-24 * time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	return kp.CertPEM
}

// withoutNow drops the time a validity error says it is.
func withoutNow(s string) string {
	return regexp.MustCompile(`it is \S+ here`).ReplaceAllString(s, "it is NOW here")
}

// TestNewConfigRidesRotationInProgress: a pair caught half written (the
// certificate new, its key not yet) does not fail a config built now when
// the rest arrives within the debounce: the config waits for it and gets
// the new pair.
func TestNewConfigRidesRotationInProgress(t *testing.T) {
	users := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: users.record})
	clock := &testClock{}
	p := newPool(t, withoutWatching(), clock.option(), withDebounce(time.Second))
	d := writeCredFiles(t, filepath.Join(f.dir, "pair"), f.ca.CertPEM(), f.alice)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	first := buildAndList(ctx, p, "TransportFor", d, f.srv.URL())
	if first.failed != "" {
		t.Fatalf("the first config: %s: %s", first.failed, first.reason)
	}
	writeAtomic(t, d.cert, f.bob.CertPEM)
	clock.advance(2 * time.Second)
	done := make(chan newConfigResult, 1)
	go func() { done <- buildAndList(ctx, p, "TransportFor", d, f.srv.URL()) }()
	waitFor(t, "the torn pair rejected", func() bool { return p.Stats().RotationErrors > 0 })
	writeAtomic(t, d.key, f.bob.KeyPEM)
	got := <-done
	if got.failed != "" {
		t.Fatalf("a config built during the rotation: %s: %s", got.failed, got.reason)
	}
	if n := users.cns()["bob"]; n != 1 {
		t.Errorf("the server saw bob %d times, want once (the new config, on the new pair): %v", n, users.cns())
	}
	runtime.KeepAlive(first.cfg)
}

// TestHalfPairWithToken: a config with only a key (or only a certificate)
// inline and a bearer token is taken as client-go takes it: no client
// certificate, the token authenticates; the server sees the token's user
// through client-go alone, TransportFor and Wrap.
func TestHalfPairWithToken(t *testing.T) {
	var (
		mu    sync.Mutex
		users []string
	)
	f := newFixture(t, testserver.Options{Tokens: map[string]string{"half-pair-token": "token-user"}, ClientAuth: testserver.VerifyClientCertIfGiven,
		OnRequest: func(ri testserver.RequestInfo) {
			mu.Lock()
			users = append(users, ri.User)
			mu.Unlock()
		}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := newPool(t)
	for _, half := range []string{"key only", "certificate only"} {
		cfg := func() *rest.Config {
			c := &rest.Config{Host: f.srv.URL(), BearerToken: "half-pair-token"}
			c.CAData = f.ca.CertPEM()
			if half == "key only" {
				c.KeyData = f.alice.KeyPEM
			} else {
				c.CertData = f.alice.CertPEM
			}
			return c
		}
		for _, via := range []string{"client-go alone", "TransportFor", "Wrap"} {
			var err error
			switch c := cfg(); via {
			case "client-go alone":
				err = listNodes(ctx, c)
			case "TransportFor":
				client, herr := p.HTTPClientFor(c)
				if herr != nil {
					err = herr
					break
				}
				cs, cerr := kubernetes.NewForConfigAndClient(c, client)
				if cerr != nil {
					err = cerr
					break
				}
				_, err = cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			case "Wrap":
				if err = p.Wrap(c); err == nil {
					err = listNodes(ctx, c)
				}
			}
			mu.Lock()
			last := ""
			if len(users) > 0 {
				last = users[len(users)-1]
			}
			users = nil
			mu.Unlock()
			if err != nil || last != "token-user" {
				t.Errorf("%s, %s: %v; the server saw user %q, want token-user", half, via, err, last)
			}
		}
	}
}
