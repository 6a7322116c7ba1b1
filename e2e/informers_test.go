package e2e

import (
	"context"
	"net/http"
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sharedtransport/sharedtransport"
)

const startupLists = 150

// startInformers starts informers for 10 resource types on cs and waits for
// them to sync. The caller closes stop.
func startInformers(t *testing.T, cs kubernetes.Interface, stop <-chan struct{}) informers.SharedInformerFactory {
	t.Helper()
	f := informers.NewSharedInformerFactory(cs, 0)
	for _, inf := range []cache.SharedIndexInformer{
		f.Core().V1().Namespaces().Informer(),
		f.Core().V1().ConfigMaps().Informer(),
		f.Core().V1().Secrets().Informer(),
		f.Core().V1().ServiceAccounts().Informer(),
		f.Core().V1().Services().Informer(),
		f.Core().V1().Pods().Informer(),
		f.Apps().V1().Deployments().Informer(),
		f.Apps().V1().StatefulSets().Informer(),
		f.Apps().V1().DaemonSets().Informer(),
		f.Rbac().V1().ClusterRoles().Informer(),
	} {
		_ = inf
	}
	f.Start(stop)
	return f
}

func waitSynced(t *testing.T, f informers.SharedInformerFactory, timeout time.Duration) {
	t.Helper()
	stop := make(chan struct{})
	timer := time.AfterFunc(timeout, func() { close(stop) })
	defer timer.Stop()
	for typ, ok := range f.WaitForCacheSync(stop) {
		if !ok {
			t.Fatalf("informer for %v did not sync within %v", typ, timeout)
		}
	}
}

type informerResult struct {
	listErrors     int64
	firstErr       error
	accepted, peak int // counted by a relay in front of kube-apiserver
	open           int
	elapsed        time.Duration
}

// informerStartup starts 10 informers and startupLists concurrent lists at
// once through one clientset of the config newConfig builds for the given
// server URL (a relay in front of kube-apiserver, which counts the
// connections).
func informerStartup(t *testing.T, newConfig func(server string) (*rest.Config, error)) (informerResult, *kubernetes.Clientset) {
	relay := startTLSRelay(t, cl(t).port)
	defer relay.close()
	cfg, err := newConfig(relay.url())
	if err != nil {
		t.Fatal(err)
	}
	// Without this client-go's default rate limit (5 QPS, burst 10) would
	// serialize the lists over half a minute instead of sending them at once.
	cfg.QPS, cfg.Burst = 1000, 1000
	cs := mustClientset(t, cfg)
	stop := make(chan struct{})
	defer close(stop)
	start := time.Now()
	f := startInformers(t, cs, stop)
	errs, first := runWorkers(startupLists, 1, func(_, _ int) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := cs.CoreV1().ConfigMaps(testNamespace).List(ctx, metav1.ListOptions{})
		return err
	})
	waitSynced(t, f, 60*time.Second)
	r := informerResult{listErrors: errs, firstErr: first, elapsed: time.Since(start)}
	time.Sleep(200 * time.Millisecond) // let a surplus connection of the start-up race close
	r.accepted, r.peak, _, _ = relay.counts()
	r.open = relay.open()
	return r, cs
}

func TestInformersStartup(t *testing.T) {
	c := cl(t)
	kubeconfig := c.kubeconfig("admin", false)

	// Three rounds each, interleaved: both dial as net/http dials, so a
	// cold start's count varies from run to run, and medians compare.
	var pooledAccepted, plainAccepted []int
	for round := 1; round <= 3; round++ {
		p := sharedtransport.New()
		pooled, _ := informerStartup(t, func(server string) (*rest.Config, error) { return p.BuildConfigFromFlags(server, kubeconfig) })
		logStats(t, "pool", p)
		closePool(t, p)
		t.Logf("round %d, sharedtransport: 10 informers + %d lists synced in %v: the server accepted %d connections, at most %d open at once, %d open after sync",
			round, startupLists, pooled.elapsed.Round(time.Millisecond), pooled.accepted, pooled.peak, pooled.open)
		if pooled.listErrors > 0 {
			t.Errorf("sharedtransport: %d of %d lists failed, first: %v", pooled.listErrors, startupLists, pooled.firstErr)
		}
		pooledAccepted = append(pooledAccepted, pooled.accepted)

		plain, plainCS := informerStartup(t, func(server string) (*rest.Config, error) { return clientcmd.BuildConfigFromFlags(server, kubeconfig) })
		time.Sleep(100 * time.Millisecond) // the informers stopped; their watches end
		closeIdle([]*http.Client{httpClientOf(plainCS)})
		t.Logf("round %d, client-go alone: 10 informers + %d lists synced in %v: the server accepted %d connections, at most %d open at once, %d open after sync",
			round, startupLists, plain.elapsed.Round(time.Millisecond), plain.accepted, plain.peak, plain.open)
		plainAccepted = append(plainAccepted, plain.accepted)
	}
	// A cold burst's count varies widely from run to run: the pool's median
	// against the most client-go alone accepted in a round.
	if median(pooledAccepted) > 2*slices.Max(plainAccepted) {
		t.Errorf("sharedtransport: a median of %d connections accepted (%v), more than twice the most client-go alone accepted in a round (%v)",
			median(pooledAccepted), pooledAccepted, plainAccepted)
	}
}
