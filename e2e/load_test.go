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
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport"
)

const (
	loadWorkers    = 100
	loadPerWorker  = 20
	loadMaxPooled  = 2 // 100 concurrent requests fit in one HTTP/2 connection; one more for a cold-start race
	sampleInterval = 20 * time.Millisecond
)

type loadResult struct {
	errors         int64
	firstErr       error
	distinct, peak int
	openAtEnd      int
	elapsed        time.Duration
}

func (r loadResult) String() string {
	return fmt.Sprintf("%d requests in %v, %d errors, %d distinct connections seen, peak %d open, %d open at the end",
		loadWorkers*loadPerWorker, r.elapsed.Round(time.Millisecond), r.errors, r.distinct, r.peak, r.openAtEnd)
}

// seedLoad runs the seed's load: loadWorkers workers, each request through a
// fresh config built from a kubeconfig file and a fresh clientset.
func seedLoad(t *testing.T, newConfig func() (*rest.Config, error), keep func(*kubernetes.Clientset)) loadResult {
	c := cl(t)
	w := watchConns(t, c.port, sampleInterval)
	start := time.Now()
	errs, first := runWorkers(loadWorkers, loadPerWorker, func(_, _ int) error {
		cfg, err := newConfig()
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(cfg)
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
	r.distinct, r.peak = w.Seen()
	r.openAtEnd = w.Open()
	w.Stop()
	return r
}

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
			pooled := seedLoad(t, func() (*rest.Config, error) {
				if !withProxy {
					return p.BuildConfigFromFlags("", kubeconfig)
				}
				cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
				if err != nil {
					return nil, err
				}
				cfg.Proxy = nilProxy
				return cfg, p.Wrap(cfg)
			}, nil)
			stats := logStats(t, "pool", p)
			closePool(t, p)
			t.Logf("sharedtransport: %v", pooled)

			// client-go as is, beside it.
			var (
				mu      sync.Mutex
				clients []*http.Client
			)
			plain := seedLoad(t, func() (*rest.Config, error) {
				cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
				if err != nil {
					return nil, err
				}
				if withProxy {
					cfg.Proxy = nilProxy
				}
				return cfg, nil
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
			if pooled.distinct > loadMaxPooled || pooled.openAtEnd > loadMaxPooled {
				t.Errorf("sharedtransport: %d distinct connections seen, %d open at the end; want at most %d", pooled.distinct, pooled.openAtEnd, loadMaxPooled)
			}
			if pooled.distinct == 0 {
				t.Errorf("sharedtransport: no connection to the apiserver was seen; the counting is broken")
			}
			if stats.Dials > loadMaxPooled {
				t.Errorf("sharedtransport: the pool dialed %d connections, want at most %d", stats.Dials, loadMaxPooled)
			}
			if withProxy && plain.distinct <= pooled.distinct {
				t.Errorf("client-go alone with Proxy set used %d connections, not more than the pool's %d: the comparison is broken", plain.distinct, pooled.distinct)
			}
		})
	}
}
