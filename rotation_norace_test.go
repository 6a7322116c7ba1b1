//go:build !race

package sharedtransport

// client-go's certificate-file callback (transport/cert_rotation.go) reads
// the certificate it cached outside its lock, and its refresher retries at
// once while a key does not match: under the race detector a client-go
// transport of a files + Proxy config (the controls here) finds that race
// inside client-go across a rotation, with or without the pool. These tests
// run without -race: in .ci/run's Go 1.27 run and in
// hack/patched-client-go.sh.

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestRotationFilesProxyBadKey: a client from HTTPClientFor of a config with
// certificate files and a Proxy function lives through a key that stops
// matching its certificate and then a rotation: its requests keep working
// with the last good pair, and after the rotation it presents the new
// certificate. hack/patched-client-go.sh
// runs it against a client-go whose unexported structs carry extra fields.
func TestRotationFilesProxyBadKey(t *testing.T) {
	rec, f, p, d, cfg := filesProxy(t, renameOver)
	cs := mustPooled(t, p, cfg)
	list := func(c kubernetes.Interface) { t.Helper(); listNodesOf(t, c) }
	list(cs)
	// Past client-go's one-second cache of the files, so that what the
	// client's own transport would read next is the bad pair.
	time.Sleep(certSettle + 300*time.Millisecond)
	writeAtomic(t, d.key, f.bob.KeyPEM)
	waitFor(t, "the pool rejects the mismatched key", func() bool { return p.Stats().RotationErrors > 0 })
	list(cs)
	if seen := rec.cns(); seen["alice"] != 2 || len(seen) != 1 {
		t.Errorf("with a mismatched key on disk the server saw %v, want 2 requests from alice", seen)
	}
	d.write(t, f.bob, f.ca.CertPEM())
	waitFor(t, "the pool takes the new pair into use", func() bool { return p.Stats().Rotations == 1 })
	written := time.Now()
	waitFor(t, "an existing client presents the new certificate", func() bool {
		list(cs)
		_, ok := rec.firstSince("bob", written)
		return ok
	})
}

// filesProxy is alice's certificate files written as layout, a config of
// them with a Proxy function, and a pool that does not poll; rec records who
// the server saw.
func filesProxy(t *testing.T, layout string) (*cnRecorder, *fixture, *Pool, *certDir, *rest.Config) {
	t.Helper()
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, layout, f.alice, f.ca.CertPEM())
	cfg := d.config(f.srv.URL())
	cfg.Proxy = nilProxy
	return rec, f, p, d, cfg
}

// TestRotationFilesProxyNoLostRequest: a files + Proxy client, one request,
// a key that stops matching, then a valid pair written certificate first:
// the client's next request is served, through the pool as through
// client-go alone (the control, on a twin of the files). Run with -count=5:
// on 387e204 the pool's question to client-go's certificate-file callback
// made that callback close the connection the request was about to use;
// the pool now asks no callback of client-go's.
func TestRotationFilesProxyNoLostRequest(t *testing.T) {
	_, f, p, d, cfg := filesProxy(t, renameOver)
	twin := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	control := twin.config(f.srv.URL())
	control.Proxy = nilProxy
	clients := map[string]kubernetes.Interface{"through the pool": mustPooled(t, p, cfg), "client-go alone": mustClientset(t, control)}
	for _, cs := range clients {
		listNodesOf(t, cs)
	}
	for _, dir := range []*certDir{d, twin} {
		writeAtomic(t, dir.key, f.bob.KeyPEM)
	}
	waitFor(t, "the pool rejects the mismatched key", func() bool { return p.Stats().RotationErrors > 0 })
	for _, dir := range []*certDir{d, twin} {
		writeAtomic(t, dir.cert, f.carol.CertPEM)
		writeAtomic(t, dir.key, f.carol.KeyPEM)
	}
	waitFor(t, "the pool takes the new pair into use", func() bool { return p.Stats().Rotations == 1 })
	time.Sleep(certSettle + 300*time.Millisecond) // past client-go's cache of the files
	for name, cs := range clients {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		cancel()
		if err != nil {
			t.Errorf("%s: the request after the rotation failed: %v", name, err)
		}
	}
}
