package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
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
// of kube-apiserver, which counts the connections) and a fresh clientset;
// after a first request alone when warm.
func seedLoad(t *testing.T, warm bool, newClient func(server string) (*kubernetes.Clientset, error), keep func(*kubernetes.Clientset)) loadResult {
	relay := startTLSRelay(t, cl(t).port)
	start := time.Now()
	request := func(_, _ int) error {
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
	}
	if warm {
		if err := request(0, 0); err != nil {
			t.Fatal(err)
		}
	}
	errs, first := runWorkers(loadWorkers, loadPerWorker, request)
	r := loadResult{errors: errs, firstErr: first, elapsed: time.Since(start)}
	r.accepted, r.peak, _, _ = relay.counts()
	r.openAtEnd = relay.open()
	relay.close()
	return r
}

// TestSeedLoad: the seed's load against kube-apiserver, once a first request
// opened a connection. With the pool, with Proxy set (Karmada's member
// configs, through HTTPClientFor) or not (through Wrap), the server accepts
// no more connections than for client-go's best case, configs without Proxy
// that its cache gives one transport: the one connection carries every
// request; client-go alone with Proxy set, one per request. (A cold start
// dials as net/http dials: conncount measures it.)
func TestSeedLoad(t *testing.T) {
	c := cl(t)
	kubeconfig := c.kubeconfig("admin", false)
	modes := []string{"client-go's best case", "sharedtransport, Wrap", "sharedtransport, HTTPClientFor with Proxy"}
	accepted := map[string]int{}
	for _, mode := range modes {
		p := sharedtransport.New()
		var (
			mu      sync.Mutex
			clients []*http.Client
		)
		r := seedLoad(t, true, func(server string) (*kubernetes.Clientset, error) {
			switch mode {
			case "sharedtransport, Wrap":
				cfg, err := p.BuildConfigFromFlags(server, kubeconfig)
				if err != nil {
					return nil, err
				}
				return kubernetes.NewForConfig(cfg)
			case "sharedtransport, HTTPClientFor with Proxy":
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
			}
			cfg, err := clientcmd.BuildConfigFromFlags(server, kubeconfig)
			if err != nil {
				return nil, err
			}
			return kubernetes.NewForConfig(cfg)
		}, func(cs *kubernetes.Clientset) {
			mu.Lock()
			clients = append(clients, httpClientOf(cs))
			mu.Unlock()
		})
		t.Logf("%s: %v", mode, r)
		if mode == modes[0] {
			closeIdle(clients)
		} else {
			stats := logStats(t, mode, p)
			if r.errors > 0 {
				t.Errorf("%s: %d of %d requests failed, first: %v", mode, r.errors, loadWorkers*loadPerWorker, r.firstErr)
			}
			if stats.Dials != uint64(r.accepted) {
				t.Errorf("%s: the pool dialed %d, the server accepted %d", mode, stats.Dials, r.accepted)
			}
		}
		closePool(t, p)
		accepted[mode] = r.accepted
	}
	for _, mode := range modes[1:] {
		if accepted[mode] > max(accepted[modes[0]], 1) {
			t.Errorf("%s: %d connections accepted, client-go's best case %d", mode, accepted[mode], accepted[modes[0]])
		}
	}

	// client-go alone with Proxy set: a transport per config.
	var (
		mu      sync.Mutex
		clients []*http.Client
	)
	plain := seedLoad(t, false, func(server string) (*kubernetes.Clientset, error) {
		cfg, err := clientcmd.BuildConfigFromFlags(server, kubeconfig)
		if err != nil {
			return nil, err
		}
		cfg.Proxy = nilProxy
		return kubernetes.NewForConfig(cfg)
	}, func(cs *kubernetes.Clientset) {
		mu.Lock()
		clients = append(clients, httpClientOf(cs))
		mu.Unlock()
	})
	closeIdle(clients)
	t.Logf("client-go alone with Proxy set: %v", plain)
	if plain.accepted < loadWorkers*loadPerWorker {
		t.Errorf("client-go alone with Proxy set: the server accepted %d connections, want one per request (%d): the comparison is broken",
			plain.accepted, loadWorkers*loadPerWorker)
	}
}

// median is the middle of counts.
func median(counts []int) int {
	sorted := slices.Clone(counts)
	slices.Sort(sorted)
	return sorted[len(sorted)/2]
}
