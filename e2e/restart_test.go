package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

func getDefault(cs kubernetes.Interface, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
	return err
}

// untilOK retries fn every 50ms until it succeeds or timeout passes, and
// returns how long it took, the attempts, and the last error.
func untilOK(timeout time.Duration, fn func() error) (time.Duration, int, error) {
	start := time.Now()
	attempts := 0
	for {
		attempts++
		err := fn()
		if err == nil || time.Since(start) > timeout {
			return time.Since(start), attempts, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestCARotation restarts kube-apiserver with a serving certificate from a
// new CA on the same port, then replaces the CA file the kubeconfig names:
// requests through the pool's existing clients recover.
func TestCARotation(t *testing.T) {
	c := cl(t)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := writeFile(caFile, c.origCA.CertPEM()); err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "ca-rotation.kubeconfig")
	if err := writeKubeconfig(kubeconfig,
		&clientcmdapi.Cluster{Server: c.url(), CertificateAuthority: caFile},
		&clientcmdapi.AuthInfo{ClientCertificate: filepath.Join(c.dir, "pki", "admin.crt"), ClientKey: filepath.Join(c.dir, "pki", "admin.key")},
	); err != nil {
		t.Fatal(err)
	}
	p := sharedtransport.New(sharedtransport.WithPollInterval(time.Second), sharedtransport.WithDrainTimeout(2*time.Second))
	defer closePool(t, p)
	cfg, err := p.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cs := mustClientset(t, cfg)
	if err := getDefault(cs, 10*time.Second); err != nil {
		t.Fatalf("before the rotation: %v", err)
	}

	newCA, err := testserver.NewCA("e2e-serving-ca-2")
	if err != nil {
		t.Fatal(err)
	}
	newServing, err := newCA.IssueServer(servingHosts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.restartAPIServer(c.origCA, c.origPair); err != nil {
			t.Errorf("restore the original serving certificate: %v", err)
		}
	})
	start := time.Now()
	if err := c.restartAPIServer(newCA, newServing); err != nil {
		t.Fatalf("restart kube-apiserver with the new serving certificate: %v", err)
	}
	t.Logf("kube-apiserver restarted with a serving certificate from a new CA in %v", time.Since(start).Round(time.Millisecond))

	// The old CA no longer verifies the server: the test changed something.
	if err := getDefault(cs, 5*time.Second); err == nil {
		t.Fatalf("a request trusting only the old CA succeeded against the new serving certificate")
	} else {
		t.Logf("with the old CA file, as expected: %v", err)
	}

	if err := replaceFile(caFile, newCA.CertPEM()); err != nil {
		t.Fatal(err)
	}
	took, attempts, err := untilOK(30*time.Second, func() error { return getDefault(cs, 5*time.Second) })
	if err != nil {
		t.Fatalf("requests did not recover within 30s of the CA file update (%d attempts): %v", attempts, err)
	}
	t.Logf("requests recovered %v after the CA file update (%d attempts)", took.Round(time.Millisecond), attempts)

	// Everything succeeds now, through the old clientset and fresh ones.
	errs, first := runWorkers(10, 10, func(w, _ int) error {
		client := kubernetes.Interface(cs)
		if w%2 == 1 {
			cfg, err := p.BuildConfigFromFlags("", kubeconfig)
			if err != nil {
				return err
			}
			if client, err = kubernetes.NewForConfig(cfg); err != nil {
				return err
			}
		}
		return getDefault(client, 10*time.Second)
	})
	if errs > 0 {
		t.Errorf("%d of 100 requests failed after the CA rotation, first: %v", errs, first)
	}
	logStats(t, "pool", p)
}

// TestAPIServerRestart kills kube-apiserver and starts it again on the same
// port: requests succeed again as soon as it is ready, and informers resync.
func TestAPIServerRestart(t *testing.T) {
	c := cl(t)
	p := sharedtransport.New()
	defer closePool(t, p)
	cfg, err := p.BuildConfigFromFlags("", c.kubeconfig("admin", false))
	if err != nil {
		t.Fatal(err)
	}
	cs := mustClientset(t, cfg)
	stop := make(chan struct{})
	defer close(stop)
	f := startInformers(t, cs, stop)
	waitSynced(t, f, 60*time.Second)
	if err := getDefault(cs, 10*time.Second); err != nil {
		t.Fatal(err)
	}

	c.killAPIServer()
	if err := getDefault(cs, 5*time.Second); err == nil {
		t.Fatalf("a request succeeded while kube-apiserver was down")
	} else {
		t.Logf("while down, as expected: %v", err)
	}
	start := time.Now()
	if err := c.startAPIServer(); err != nil {
		t.Fatalf("restart kube-apiserver: %v", err)
	}
	ready := time.Now()
	t.Logf("kube-apiserver ready again %v after start", ready.Sub(start).Round(time.Millisecond))

	took, attempts, err := untilOK(10*time.Second, func() error { return getDefault(cs, 5*time.Second) })
	if err != nil {
		t.Fatalf("requests did not succeed within 10s of readiness (%d attempts): %v", attempts, err)
	}
	t.Logf("first successful request %v after readiness (%d attempts)", took.Round(time.Millisecond), attempts)
	if attempts > 1 {
		t.Errorf("the first %d requests after readiness failed; want the first to succeed", attempts-1)
	}
	fresh, err := p.BuildConfigFromFlags("", c.kubeconfig("admin", false))
	if err != nil {
		t.Fatal(err)
	}
	if err := getDefault(mustClientset(t, fresh), 10*time.Second); err != nil {
		t.Errorf("fresh config after the restart: %v", err)
	}

	// The informers come back too (the reflectors back off while the server
	// is down, so give them time).
	name := fmt.Sprintf("after-restart-%d", time.Now().UnixNano())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cs.CoreV1().ConfigMaps(testNamespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create configmap: %v", err)
	}
	lister := f.Core().V1().ConfigMaps().Lister().ConfigMaps(testNamespace)
	took, _, err = untilOK(60*time.Second, func() error { _, err := lister.Get(name); return err })
	if err != nil {
		t.Errorf("the configmap informer did not see %s within 60s of the restart: %v", name, err)
	} else {
		t.Logf("the configmap informer saw a new object %v after it was created", took.Round(time.Millisecond))
	}
	logStats(t, "pool", p)
}
