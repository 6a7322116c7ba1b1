package e2e

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport"
)

const (
	loadWorkers   = 100
	loadPerWorker = 20
)

type loadResult struct {
	errors         int64
	firstErr       error
	accepted, peak int // counted by a relay in front of kube-apiserver
	openAtEnd      int
	elapsed        time.Duration
}

func (r loadResult) String() string {
	return fmt.Sprintf("%d requests in %v, %d errors; the server accepted %d connections, at most %d open at once, %d open at the end",
		loadWorkers*loadPerWorker, r.elapsed.Round(time.Millisecond), r.errors, r.accepted, r.peak, r.openAtEnd)
}

// seedLoad runs the seed's load: loadWorkers workers, each request through a
// fresh config built by newConfig for the given server URL (a relay in front
// of kube-apiserver, which counts the connections) and a fresh clientset.
func seedLoad(t *testing.T, newClient func(server string) (*kubernetes.Clientset, error), keep func(*kubernetes.Clientset)) loadResult {
	relay := startTLSRelay(t, cl(t).port)
	start := time.Now()
	errs, first := runWorkers(loadWorkers, loadPerWorker, func(_, _ int) error {
		cs, err := newClient(relay.url())
		if err != nil {
			return err
		}
		if keep != nil {
			keep(cs)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err = cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
		return err
	})
	r := loadResult{errors: errs, firstErr: first, elapsed: time.Since(start)}
	r.accepted, r.peak, _, _ = relay.counts()
	r.openAtEnd = relay.open()
	relay.close()
	return r
}

// TestSeedLoad: the seed's load against kube-apiserver. With the pool, with
// Proxy set (Karmada's member configs, through HTTPClientFor) or not
// (through Wrap), the server accepts exactly one
// connection (100 requests in flight fit in its 100 streams, and the pool's
// first request leads); client-go alone with Proxy set, one per request.
func TestSeedLoad(t *testing.T) {
	c := cl(t)
	kubeconfig := c.kubeconfig("admin", false)
	for _, withProxy := range []bool{false, true} {
		name := "NoProxy"
		if withProxy {
			name = "NilProxy"
		}
		t.Run(name, func(t *testing.T) {
			// With the library.
			p := sharedtransport.New()
			pooled := seedLoad(t, func(server string) (*kubernetes.Clientset, error) {
				if !withProxy {
					cfg, err := p.BuildConfigFromFlags(server, kubeconfig)
					if err != nil {
						return nil, err
					}
					return kubernetes.NewForConfig(cfg)
				}
				cfg, err := clientcmd.BuildConfigFromFlags(server, kubeconfig)
				if err != nil {
					return nil, err
				}
				cfg.Proxy = nilProxy // Wrap passes it through: HTTPClientFor
				hc, err := p.HTTPClientFor(cfg)
				if err != nil {
					return nil, err
				}
				return kubernetes.NewForConfigAndClient(cfg, hc)
			}, nil)
			stats := logStats(t, "pool", p)
			closePool(t, p)
			t.Logf("sharedtransport: %v", pooled)

			// client-go as is, beside it.
			var (
				mu      sync.Mutex
				clients []*http.Client
			)
			plain := seedLoad(t, func(server string) (*kubernetes.Clientset, error) {
				cfg, err := clientcmd.BuildConfigFromFlags(server, kubeconfig)
				if err != nil {
					return nil, err
				}
				if withProxy {
					cfg.Proxy = nilProxy
				}
				return kubernetes.NewForConfig(cfg)
			}, func(cs *kubernetes.Clientset) {
				mu.Lock()
				clients = append(clients, httpClientOf(cs))
				mu.Unlock()
			})
			closeIdle(clients)
			t.Logf("client-go alone: %v", plain)

			if pooled.errors > 0 {
				t.Errorf("sharedtransport: %d of %d requests failed, first: %v", pooled.errors, loadWorkers*loadPerWorker, pooled.firstErr)
			}
			if plain.errors > 0 {
				t.Logf("client-go alone: %d requests failed, first: %v", plain.errors, plain.firstErr)
			}
			if pooled.accepted != 1 || stats.Dials != 1 {
				t.Errorf("sharedtransport: the server accepted %d connections and the pool dialed %d, want 1", pooled.accepted, stats.Dials)
			}
			if withProxy && plain.accepted < loadWorkers*loadPerWorker {
				t.Errorf("client-go alone with Proxy set: the server accepted %d connections, want one per request (%d): the comparison is broken",
					plain.accepted, loadWorkers*loadPerWorker)
			}
		})
	}
}
