package sharedtransport

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"path/filepath"
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

// TestConcurrency races Wrap, requests, rotations of watched files, garbage
// collection of identities and Close against each other, pool after pool,
// for about five seconds. Run it under -race. Nothing may fail before Close
// starts; afterwards only with ErrClosed or a closed connection. Every
// request carries the certificate its config holds. Goroutines (goleak in
// TestMain) and file descriptors come back to where they were.
func TestConcurrency(t *testing.T) {
	total := 5 * time.Second
	if testing.Short() {
		total = time.Second
	}
	var violations atomic.Int64
	var firstViolation atomic.Value
	f := newFixture(t, testserver.Options{OnRequest: func(ri testserver.RequestInfo) {
		tg, cn, ok := parseTag(ri.UserAgent)
		if !ok {
			return
		}
		okCN := ri.CertCN == cn
		if tg == "files" {
			okCN = strings.HasPrefix(ri.CertCN, "alice-v") // rotating: any version of alice
		}
		if !okCN {
			violations.Add(1)
			firstViolation.CompareAndSwap(nil, fmt.Sprintf("config %s got a connection authenticated as %q", tg, ri.CertCN))
		}
	}})
	otherCA, err := testserver.NewCA("other-ca")
	if err != nil {
		t.Fatal(err)
	}
	proxy := newConnectProxy(t)
	var versions []*testserver.KeyPair
	for i := range 8 {
		versions = append(versions, issueForKey(t, f.ca, fmt.Sprintf("alice-v%d", i), f.alice))
	}
	caBundles := [][]byte{f.ca.CertPEM(), append(f.ca.CertPEM(), otherCA.CertPEM()...)}
	files := writeCredFiles(t, filepath.Join(f.dir, "race"), caBundles[0], versions[0])

	var configs atomic.Int64
	newConfig := func(kind int) *rest.Config {
		var cfg *rest.Config
		switch kind {
		case 0:
			cfg = files.config(f.srv.URL())
			tag(cfg, "files", "")
		case 1:
			cfg = f.srv.RestConfig(f.alice)
			tag(cfg, "alice", "alice")
		case 2:
			cfg = f.srv.RestConfig(f.bob)
			tag(cfg, "bob", "bob")
		default:
			// A new identity every time (the proxy ignores the user
			// name), collected once dropped.
			cfg = f.srv.RestConfig(f.carol)
			u, _ := url.Parse(proxy.url())
			u.User = url.User(fmt.Sprintf("u%d", configs.Add(1)))
			cfg.Proxy = http.ProxyURL(u)
			tag(cfg, "proxied", "carol")
		}
		cfg.QPS, cfg.Burst = 1e6, 1e6
		return cfg
	}

	type tally struct {
		wraps, requests, rotations, gcs, afterClose, closes, passThrough atomic.Int64
	}
	var counts tally
	var unexpected sync.Map // message -> count
	round := func(length time.Duration) {
		p := New(WithIdleTimeout(0), withDebounce(time.Millisecond), WithPollInterval(20*time.Millisecond))
		var closing atomic.Bool
		check := func(what string, err error) {
			if err == nil {
				return
			}
			if closing.Load() && closedError(err) {
				counts.afterClose.Add(1)
				return
			}
			msg := fmt.Sprintf("%s (closing: %v): %v", what, closing.Load(), reason(err))
			n, _ := unexpected.LoadOrStore(msg, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		spawn := func(fn func(r *rand.Rand)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
				for {
					select {
					case <-stop:
						return
					default:
					}
					fn(r)
				}
			}()
		}
		list := func(cs *kubernetes.Clientset) error {
			_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			return err
		}

		// Wrap fresh configs of every kind, use them once, drop them.
		for range 4 {
			spawn(func(r *rand.Rand) {
				cfg := newConfig(r.IntN(4))
				err := p.Wrap(cfg)
				check("Wrap", err)
				if err != nil {
					return
				}
				counts.wraps.Add(1)
				cs, err := kubernetes.NewForConfig(cfg)
				check("NewForConfig", err)
				if err == nil {
					err = list(cs)
					check("request on a fresh config", err)
					if err == nil {
						counts.requests.Add(1)
					}
				}
			})
		}
		// Long-lived clients, built once.
		for kind := range 4 {
			cfg := newConfig(kind)
			if err := p.Wrap(cfg); err != nil {
				t.Fatal(err)
			}
			cs, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
			for range 2 {
				spawn(func(*rand.Rand) {
					err := list(cs)
					check("request on a long-lived client", err)
					if err == nil {
						counts.requests.Add(1)
					}
				})
			}
		}
		// Rotate the certificate (same key, new certificate: every mix of
		// versions read from disk is a valid pair) and the CA bundle.
		spawn(func(r *rand.Rand) {
			writeAtomic(t, files.cert, versions[r.IntN(len(versions))].CertPEM)
			writeAtomic(t, files.ca, caBundles[r.IntN(2)])
			counts.rotations.Add(1)
			time.Sleep(time.Duration(5+r.IntN(20)) * time.Millisecond)
		})
		spawn(func(r *rand.Rand) {
			runtime.GC()
			counts.gcs.Add(1)
			time.Sleep(time.Duration(r.IntN(10)) * time.Millisecond)
		})
		spawn(func(*rand.Rand) {
			_ = p.Stats()
			time.Sleep(time.Millisecond)
		})

		time.Sleep(length * time.Duration(50+rand.IntN(40)) / 100)
		closing.Store(true)
		var closers sync.WaitGroup
		for range 2 { // Close is idempotent, also when raced
			closers.Add(1)
			go func() {
				defer closers.Done()
				if err := p.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
				counts.closes.Add(1)
			}()
		}
		closers.Wait()
		time.Sleep(length / 10) // everyone keeps going against the closed pool
		close(stop)
		wg.Wait()
		// A connection dialed by a request that raced Close must be
		// closed too, not left for the server's or the idle timeout.
		deadline := time.Now().Add(5 * time.Second)
		for p.Stats().OpenConns != 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if st := p.Stats(); st.OpenConns != 0 {
			t.Errorf("a closed pool still counts %d open connections", st.OpenConns)
		}
		counts.passThrough.Add(int64(p.Stats().PassThrough))
	}

	// Connections the pool does not own: a file config whose files changed
	// since the pool last read them is passed through to client-go's own
	// transport (its material differs), and client-go keeps those idle.
	closeOthers := func() {
		f.srv.CloseClientConnections()
		waitFor(t, "server connections closed", func() bool { return f.srv.OpenConns() == 0 })
	}
	round(200 * time.Millisecond) // warm-up: lazily opened descriptors exist from now on
	closeOthers()
	baseline := countFDs(t)
	start := time.Now()
	rounds := 0
	for time.Since(start) < total {
		round(time.Second)
		rounds++
	}
	closeOthers()
	var fds int
	waitFor(t, "file descriptors back to the baseline", func() bool { fds = countFDs(t); return fds <= baseline })

	t.Logf("%d rounds in %v: %d Wraps and %d requests succeeded, %d rotations written, %d GCs, %d Closes; %d failures after Close (ErrClosed or closed connection); %d pass-throughs; fds %d -> %d",
		rounds, time.Since(start).Round(time.Millisecond), counts.wraps.Load(), counts.requests.Load(), counts.rotations.Load(),
		counts.gcs.Load(), counts.closes.Load(), counts.afterClose.Load(), counts.passThrough.Load(), baseline, fds)
	unexpected.Range(func(k, v any) bool {
		t.Errorf("%dx %s", v.(*atomic.Int64).Load(), k)
		return true
	})
	if n := violations.Load(); n > 0 {
		t.Errorf("%d requests carried the wrong certificate; first: %v", n, firstViolation.Load())
	}
}

// closedError reports whether err is how a request or Wrap fails because the
// pool was closed under it.
func closedError(err error) bool {
	if errors.Is(err, ErrClosed) {
		return true
	}
	msg := err.Error()
	for _, s := range []string{"use of closed network connection", "client connection lost", "connection reset by peer", "EOF", "http2: client conn is closed", "force closed"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}
