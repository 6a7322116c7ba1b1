package e2e

import (
	"context"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport"
)

// nilProxy is the shape of Karmada's member-cluster configs: a Proxy function
// that sends everything direct. Any non-nil Proxy makes client-go's own
// transport cache give up.
func nilProxy(*http.Request) (*url.URL, error) { return nil, nil }

// whoami asks the server which user it authenticated the client as.
func whoami(ctx context.Context, cs kubernetes.Interface) (string, error) {
	r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return r.Status.UserInfo.Username, nil
}

func mustClientset(t *testing.T, cfg *rest.Config) *kubernetes.Clientset {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("clientset: %v", err)
	}
	return cs
}

func mustWhoami(t *testing.T, cs kubernetes.Interface, want string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := whoami(ctx, cs)
	if err != nil {
		t.Fatalf("SelfSubjectReview (want %s): %v", want, err)
	}
	if got != want {
		t.Fatalf("SelfSubjectReview: server saw user %q, want %q", got, want)
	}
}

// runWorkers runs fn for workers x perWorker iterations and returns the number
// of errors and the first one.
func runWorkers(workers, perWorker int, fn func(worker, i int) error) (int64, error) {
	var (
		wg       sync.WaitGroup
		errs     atomic.Int64
		firstMu  sync.Mutex
		firstErr error
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				if err := fn(w, i); err != nil {
					errs.Add(1)
					firstMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					firstMu.Unlock()
				}
			}
		}(w)
	}
	wg.Wait()
	return errs.Load(), firstErr
}

// closeIdle closes the idle connections of client-go transports built outside
// the pool, so they do not linger into later tests.
func closeIdle(clients []*http.Client) {
	for _, c := range clients {
		if c != nil {
			utilnet.CloseIdleConnectionsFor(c.Transport)
		}
	}
}

func httpClientOf(cs *kubernetes.Clientset) *http.Client {
	if rc, ok := cs.CoreV1().RESTClient().(*rest.RESTClient); ok {
		return rc.Client
	}
	return nil
}

func logStats(t *testing.T, name string, p *sharedtransport.Pool) sharedtransport.Stats {
	t.Helper()
	s := p.Stats()
	t.Logf("%s stats: identities=%d hits=%d misses=%d passthrough=%d dials=%d open=%d handshakes=%d resumptions=%d rotations=%d rotationErrors=%d",
		name, s.Identities, s.Hits, s.Misses, s.PassThrough, s.Dials, s.OpenConns, s.Handshakes, s.Resumptions, s.Rotations, s.RotationErrors)
	return s
}

func closePool(t *testing.T, p *sharedtransport.Pool) {
	t.Helper()
	if err := p.Close(); err != nil {
		t.Errorf("Pool.Close: %v", err)
	}
}
