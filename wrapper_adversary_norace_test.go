//go:build !race

package sharedtransport

// These tests rotate the files of configs client-go itself builds
// transports for (the controls, and the copies that pass through), and
// build more of them after the change: client-go's certificate reloader
// (transport/cert_rotation.go) reads the certificate it cached outside its
// lock, so a reloader's first load that meets a handshake after the change
// is a race inside client-go, with or without the pool, which the race
// detector reports (it did in two runs of .ci/run). They run without -race,
// as rotation_norace_test.go's do: in .ci/run's Go 1.27 run.

import (
	"testing"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// TestAdversaryCopyFilesRotate: a copy names other certificate files that
// hold the original's bytes. The match is remembered for the pool's
// generation; when the COPY's files change (the original's do not), the pool
// has no new generation, re-checks nothing, and the copy keeps presenting the
// original's certificate.
func TestAdversaryCopyFilesRotate(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	h2 := "HTTP/2.0"
	for _, layout := range []string{renameOver, secretVolume} {
		t.Run(layout, func(t *testing.T) {
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, layout, f.alice, f.ca.CertPEM())
			other := newCertDir(t, layout, f.alice, f.ca.CertPEM())
			pair := wrapPair(t, p, func() *rest.Config { return d.config(r.srv.URL()) })
			cp := pair.copies(func(c *rest.Config) { c.CertFile, c.KeyFile = other.cert, other.key })
			before := r.hold(t, cp, &observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"})
			other.write(t, f.bob, f.ca.CertPEM())
			r.checkAfterFileCache(t, before, cp, observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"})
		})
	}
}

// TestAdversaryCopyFilesRotateOriginalBad: TestAdversaryCopyFilesRotate while
// the original's files are bad. A copy names other certificate files holding
// the original's bytes; its match, made by comparing what those files held,
// lasts while the original's files fail to load (so that the original's own
// clients do not read the files the pool just failed to read). The copy's
// files are not those: they change, and the copy keeps presenting the
// original's certificate for as long as the original's files stay bad.
func TestAdversaryCopyFilesRotateOriginalBad(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	r := newCopyRig(t, testserver.Options{CA: f.ca})
	p := newPool(t, WithPollInterval(0))
	d, other, pair := filesPairWithTwin(t, f, r, p)
	cp := pair.copies(func(c *rest.Config) { c.CertFile, c.KeyFile = other.cert, other.key })
	before := r.hold(t, cp, nil)
	aliceSeen := observation{CN: "alice", Proto: h2, Gzip: true, Via: "direct"}
	for i, c := range before {
		if o := c.observe(); o != aliceSeen {
			t.Fatalf("client %d before the files changed: %+v, want %+v", i, o, aliceSeen)
		}
	}
	writeAtomic(t, d.key, f.bob.KeyPEM) // the original's key no longer matches its certificate
	waitFor(t, "the original's bad key rejected", func() bool { return p.Stats().RotationErrors == 1 })
	other.write(t, f.bob, f.ca.CertPEM())
	r.checkAfterFileCache(t, before, cp, observation{CN: "bob", Proto: h2, Gzip: true, Via: "direct"})
}
