package sharedtransport

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// cnRecorder keeps the certificate CN of every request the server saw.
// certSettle is how long after a rotation client-go's transports may still
// hand out the certificate they read before it: client-go caches what it
// reads from certificate files for a second.
const certSettle = 1200 * time.Millisecond

type cnRecorder struct {
	mu   sync.Mutex
	seen []cnAt
}

type cnAt struct {
	cn string
	at time.Time
}

func (r *cnRecorder) record(ri testserver.RequestInfo) {
	r.mu.Lock()
	r.seen = append(r.seen, cnAt{ri.CertCN, time.Now()})
	r.mu.Unlock()
}

// firstSince returns when the server first saw cn at or after t.
func (r *cnRecorder) firstSince(cn string, t time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.seen {
		if s.cn == cn && !s.at.Before(t) {
			return s.at, true
		}
	}
	return time.Time{}, false
}

func (r *cnRecorder) cns() map[string]int { return r.cnsSince(time.Time{}) }

// cnsSince counts the requests the server saw at or after t, by CN.
func (r *cnRecorder) cnsSince(t time.Time) map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := map[string]int{}
	for _, s := range r.seen {
		if !s.at.Before(t) {
			m[s.cn]++
		}
	}
	return m
}

// requestLoop lists nodes through one clientset at about rate per second
// until stop is closed; it returns the number of requests and failures.
func requestLoop(cs kubernetes.Interface, rate int, stop <-chan struct{}) (reqs, fails *atomic.Int64, done <-chan struct{}) {
	reqs, fails = &atomic.Int64{}, &atomic.Int64{}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			cancel()
			reqs.Add(1)
			if err != nil {
				fails.Add(1)
			}
		}
	}()
	return reqs, fails, finished
}

func TestRotationKinds(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	for _, layout := range []string{inPlace, renameOver, secretVolume, deleteCreate, certThenKey} {
		t.Run(layout, func(t *testing.T) {
			p := newPool(t, WithPollInterval(0), WithDrainTimeout(time.Second))
			d := newCertDir(t, layout, f.alice, f.ca.CertPEM())
			cfg, cs := d.wrapped(t, p, f.srv.URL())
			stop := make(chan struct{})
			reqs, fails, done := requestLoop(cs, 50, stop)

			time.Sleep(200 * time.Millisecond)
			d.write(t, dave, f.ca.CertPEM())
			written := time.Now()
			waitFor(t, "the server sees the new certificate", func() bool {
				_, ok := rec.firstSince("dave", written)
				return ok
			})
			time.Sleep(100 * time.Millisecond)
			close(stop)
			<-done
			at, _ := rec.firstSince("dave", written)
			t.Logf("%s: new certificate on the server %v after the write; %d requests, %d failed; %+v",
				layout, at.Sub(written).Round(time.Millisecond), reqs.Load(), fails.Load(), p.Stats())
			if fails.Load() != 0 {
				t.Errorf("%d of %d requests failed during the rotation", fails.Load(), reqs.Load())
			}
			// The counter goes up just after the new material is in use, so
			// a request may show it on the server first.
			waitFor(t, "the rotation counted", func() bool { return p.Stats().Rotations >= 1 })
			if st := p.Stats(); st.Rotations != 1 {
				t.Errorf("Rotations = %d, want 1", st.Rotations)
			}
			// The same cfg, with no new rest.Config, now presents dave.
			must(t, listNodes(context.Background(), cfg))
		})
	}
	// The server saw only whole, valid certificates: a torn pair would have
	// failed the handshake, so every request above came from alice or dave.
	for cn := range rec.cns() {
		if cn != "alice" && cn != "dave" {
			t.Errorf("server saw certificate %q", cn)
		}
	}
}

// TestRotationConverges: 100 writes within a second end in the final content.
func TestRotationConverges(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	var pairs []*testserver.KeyPair
	for i := range 5 {
		kp, err := f.ca.IssueClient(fmt.Sprintf("user-%d", i))
		must(t, err)
		pairs = append(pairs, kp)
	}
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	cfg := d.config(f.srv.URL())
	must(t, p.Wrap(cfg))
	for i := range 100 {
		d.write(t, pairs[i%len(pairs)], f.ca.CertPEM())
		time.Sleep(8 * time.Millisecond)
	}
	final := pairs[99%len(pairs)]
	written := time.Now()
	waitFor(t, "the final certificate is used", func() bool {
		f.srv.CloseClientConnections()
		must(t, listNodes(context.Background(), cfg))
		_, ok := rec.firstSince(final.Cert.Subject.CommonName, written)
		return ok
	})
	t.Logf("100 writes in ~1s: %+v", p.Stats())
}

// TestRotationByPollOnly: with fsnotify off, the poll alone finds a change.
func TestRotationByPollOnly(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	const poll = 300 * time.Millisecond
	p := newPool(t, WithPollInterval(poll), func(o *options) { o.disableNotify = true })
	d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	cfg := d.config(f.srv.URL())
	must(t, p.Wrap(cfg))
	d.write(t, dave, f.ca.CertPEM())
	waitFor(t, "the poll finds the change", func() bool { return p.Stats().Rotations == 1 })
	written := time.Now()
	must(t, listNodes(context.Background(), cfg))
	if _, ok := rec.firstSince("dave", written); !ok {
		t.Error("the server did not see the new certificate")
	}
}

// TestRotationLinkElsewhere: a configured file that is a link into another
// directory, whose target a certificate manager renames new files over, is
// not in a watched directory: the poll finds the change, and a config built
// before the poll reads the files as they are then.
func TestRotationLinkElsewhere(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	target := writeCredFiles(t, filepath.Join(f.dir, "managed"), f.ca.CertPEM(), f.alice)
	dir := filepath.Join(f.dir, "config")
	must(t, os.Mkdir(dir, 0o700))
	links := &rest.Config{Host: f.srv.URL()}
	for _, l := range []struct {
		to   string
		into *string
	}{{target.ca, &links.CAFile}, {target.cert, &links.CertFile}, {target.key, &links.KeyFile}} {
		*l.into = filepath.Join(dir, filepath.Base(l.to))
		must(t, os.Symlink(l.to, *l.into))
	}
	for _, poll := range []time.Duration{0, 300 * time.Millisecond} {
		t.Run(fmt.Sprintf("poll %v", poll), func(t *testing.T) {
			p := newPool(t, WithPollInterval(poll))
			cfg := rest.CopyConfig(links)
			must(t, p.Wrap(cfg))
			kp := dave
			if poll > 0 {
				kp = f.carol
			}
			target.write(t, kp, f.ca.CertPEM())
			written := time.Now()
			if poll > 0 {
				waitFor(t, "the poll finds the change", func() bool { return p.Stats().Rotations == 1 })
			} else {
				time.Sleep(300 * time.Millisecond) // no event, no poll: no reload; a new config reads the files
				cfg = rest.CopyConfig(links)
				must(t, p.Wrap(cfg))
			}
			must(t, listNodes(context.Background(), cfg))
			if _, ok := rec.firstSince(kp.Cert.Subject.CommonName, written); !ok {
				t.Errorf("the server did not see %s", kp.Cert.Subject.CommonName)
			}
		})
	}
}

// TestRotationRejectedOnce: files that stay bad are rejected and counted
// once, however often the poll reads them (unchanged bytes are compared, not
// parsed again); the same bad files written again after good ones count
// again.
func TestRotationRejectedOnce(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	const poll = 20 * time.Millisecond
	p := newPool(t, WithPollInterval(poll))
	c := writeCredFiles(t, filepath.Join(f.dir, "files"), f.ca.CertPEM(), f.alice)
	must(t, p.Wrap(c.config(f.srv.URL())))
	for round := 1; round <= 2; round++ {
		writeAtomic(t, c.key, f.bob.KeyPEM) // the key of another certificate
		waitFor(t, "the bad key rejected", func() bool { return p.Stats().RotationErrors == uint64(round) })
		time.Sleep(15 * poll)
		if st := p.Stats(); st.RotationErrors != uint64(round) || st.Rotations != 0 {
			t.Fatalf("round %d, after 15 polls of unchanged bad files: %d rejected, %d rotations; want %d and 0", round, st.RotationErrors, st.Rotations, round)
		}
		writeAtomic(t, c.key, f.alice.KeyPEM)
		// The next round's bad key counts again only once a reload has seen
		// the good files.
		waitFor(t, "the good files seen again", func() bool { return !filesBad(p) })
	}
}

// filesBad reports whether one of p's identities holds files that failed to
// load.
func filesBad(p *Pool) bool {
	p.reg.mu.Lock()
	defer p.reg.mu.Unlock()
	for _, h := range p.reg.entries {
		if h.e.files.bad() {
			return true
		}
	}
	return false
}

// TestRotationSharedWatch: identities with files in one directory share one
// watch, and the directory is unwatched when the last of them goes.
func TestRotationSharedWatch(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(0))
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		must(t, os.WriteFile(path, data, 0o600))
		return path
	}
	ca := write("ca.crt", f.ca.CertPEM())
	alice := &rest.Config{Host: f.srv.URL()}
	alice.CAFile, alice.CertFile, alice.KeyFile = ca, write("alice.crt", f.alice.CertPEM), write("alice.key", f.alice.KeyPEM)
	bob := &rest.Config{Host: f.srv.URL()}
	bob.CAFile, bob.CertFile, bob.KeyFile = ca, write("bob.crt", f.bob.CertPEM), write("bob.key", f.bob.KeyPEM)
	for _, c := range []*rest.Config{alice, bob} {
		must(t, p.Wrap(c))
	}
	w := p.reg.watcher
	waitFor(t, "the directory watched", func() bool { return len(w.watchList()) > 0 })
	if got := w.watchList(); len(got) != 1 || got[0] != dir {
		t.Errorf("fsnotify watches %v, want only %s", got, dir)
	}
	w.mu.Lock()
	refs := len(w.dirs[dir].identities)
	w.mu.Unlock()
	if refs != 2 {
		t.Errorf("directory used by %d identities, want 2", refs)
	}
	alice, bob = nil, nil
	waitReleased(t, p)
	waitFor(t, "no directory watched once every identity was released", func() bool { return len(w.watchList()) == 0 })
}

const (
	busyBeside = "busy: file beside appended"
	busyCA     = "busy: CA file rewritten unchanged"
)

// busy keeps d's directory busy until the returned function is called: every
// period it appends a line to a file beside the certificate (busyBeside), or
// renames an unchanged copy of the CA over the CA file (busyCA).
func busy(t testing.TB, d *certDir, kind string, ca []byte, period time.Duration) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	var noiseErr error
	go func() {
		defer close(exited)
		tick := time.NewTicker(period)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			var err error
			switch kind {
			case busyBeside:
				var f *os.File
				if f, err = os.OpenFile(filepath.Join(d.dir, "audit.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); err == nil {
					_, err = fmt.Fprintf(f, "line %d\n", n)
					f.Close()
				}
			case busyCA:
				tmp := d.ca + ".busy"
				if err = os.WriteFile(tmp, ca, 0o644); err == nil {
					err = os.Rename(tmp, d.ca)
				}
			}
			if err != nil && noiseErr == nil {
				noiseErr = err
			}
		}
	}()
	return func() {
		close(done)
		<-exited
		if noiseErr != nil {
			t.Errorf("keeping the directory busy: %v", noiseErr)
		}
	}
}

// TestRotationBusyDirectory: with polling off, a certificate change is taken
// in a directory that never goes quiet. Events for a file the pool does not
// read do not put the reload off; events for one it reads (the CA, rewritten
// unchanged every 30 ms, less than the debounce) put it off no longer than
// the debounce's maximum wait.
func TestRotationBusyDirectory(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	for _, kind := range []string{busyBeside, busyCA} {
		t.Run(kind, func(t *testing.T) {
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
			cfg := d.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			stop := busy(t, d, kind, f.ca.CertPEM(), 30*time.Millisecond)
			defer stop()
			time.Sleep(300 * time.Millisecond) // the noise is under way
			d.write(t, dave, f.ca.CertPEM())
			written := time.Now()
			waitFor(t, "the rotation, the directory still busy", func() bool { return p.Stats().Rotations == 1 })
			t.Logf("rotation taken %v after the write", time.Since(written).Round(time.Millisecond))
			must(t, listNodes(context.Background(), cfg))
			if _, ok := rec.firstSince("dave", written); !ok {
				t.Error("the server did not see the new certificate")
			}
		})
	}
}

// TestRotationDrain: a watch running when the certificate changes keeps
// running on the old connection until the drain timeout, then ends; idle
// connections of the old material close at once.
func TestRotationDrain(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	const drain = 2 * time.Second
	p := newPool(t, WithPollInterval(0), WithDrainTimeout(drain))
	d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	cfg, cs := d.wrapped(t, p, f.srv.URL())
	w, err := cs.CoreV1().Nodes().Watch(context.Background(), metav1.ListOptions{})
	must(t, err)
	defer w.Stop()
	ended := make(chan time.Time, 1)
	go func() {
		for range w.ResultChan() {
		}
		ended <- time.Now()
	}()

	d.write(t, dave, f.ca.CertPEM())
	rotated := time.Now()
	waitFor(t, "rotation", func() bool { return p.Stats().Rotations == 1 })
	must(t, listNodes(context.Background(), cfg))
	if _, ok := rec.firstSince("dave", rotated); !ok {
		t.Error("a new request did not use the new certificate")
	}
	select {
	case at := <-ended:
		t.Fatalf("the watch ended %v after the rotation, before the drain timeout", at.Sub(rotated))
	case <-time.After(drain / 2):
	}
	select {
	case at := <-ended:
		t.Logf("the watch ended %v after the rotation (drain timeout %v)", at.Sub(rotated).Round(time.Millisecond), drain)
	case <-time.After(drain + 10*time.Second):
		t.Fatal("the watch outlived the drain timeout")
	}
	_ = watch.Added
}

// TestRotationClosesIdleAtOnce: the idle connection of the old material
// closes at the rotation, on the server's count, long before the drain
// timeout and with no request to trigger it.
func TestRotationClosesIdleAtOnce(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	p := newPool(t, WithPollInterval(0), WithDrainTimeout(time.Hour))
	d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	cfg, _ := d.wrapped(t, p, f.srv.URL())
	must(t, listNodes(context.Background(), cfg))
	if n := f.srv.OpenConns(); n != 1 {
		t.Fatalf("%d connections open on the server before the rotation, want 1", n)
	}
	d.write(t, dave, f.ca.CertPEM())
	waitFor(t, "rotation", func() bool { return p.Stats().Rotations == 1 })
	waitFor(t, "the server to see the old material's idle connection closed", func() bool { return f.srv.OpenConns() == 0 })
}

// longDrainRotation is a rig of rotation tests: a server, dave's
// certificate to rotate to, a pool with an hour's drain and no poll, and
// alice's files.
func longDrainRotation(t *testing.T) (*fixture, *testserver.KeyPair, *Pool, *certDir) {
	t.Helper()
	f := newFixture(t, testserver.Options{})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	p := newPool(t, WithPollInterval(0), WithDrainTimeout(time.Hour))
	return f, dave, p, newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
}

// TestRotationKeepsExec: an exec session opened on the old material goes
// on through a rotation and the lists after it, as it does through
// client-go alone, whose transport keeps the first material.
func TestRotationKeepsExec(t *testing.T) {
	for _, wrap := range []bool{false, true} {
		name := "client-go alone"
		if wrap {
			name = "pool"
		}
		t.Run(name, func(t *testing.T) {
			f, dave, p, d := longDrainRotation(t)
			cfg := d.config(f.srv.URL())
			if wrap {
				must(t, p.Wrap(cfg))
			}
			rt, err := rest.TransportFor(cfg)
			must(t, err)
			cs, err := kubernetes.NewForConfig(cfg)
			must(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			session := openExec(ctx, t, rt, f.srv.URL())
			defer session.Close()
			echo(t, session, "before the rotation")
			w, err := cs.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{})
			must(t, err)
			defer w.Stop()

			d.write(t, dave, f.ca.CertPEM())
			if wrap {
				waitFor(t, "rotation", func() bool { return p.Stats().Rotations == 1 })
			}
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Fatal(err)
			}
			echo(t, session, "after the rotation")
		})
	}
}

// openExec opens an exec session (a websocket upgrade) through rt.
func openExec(ctx context.Context, t *testing.T, rt http.RoundTripper, url string) io.ReadWriteCloser {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/api/v1/namespaces/kube-system/pods/kube-proxy-0/exec", nil)
	must(t, err)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	req.Header.Set("Sec-WebSocket-Version", "13")
	req.Header.Set("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
	req.Header.Set("Sec-WebSocket-Protocol", "v5.channel.k8s.io")
	resp, err := rt.RoundTrip(req)
	must(t, err)
	conn, ok := resp.Body.(io.ReadWriteCloser)
	if resp.StatusCode != http.StatusSwitchingProtocols || !ok {
		resp.Body.Close()
		t.Fatalf("exec answered %s with a %T body", resp.Status, resp.Body)
	}
	return conn
}

// echo writes payload to session and fails t unless it reads it back.
func echo(t *testing.T, session io.ReadWriter, payload string) {
	t.Helper()
	if _, err := io.WriteString(session, payload); err != nil {
		t.Fatalf("exec session, %s: %v", payload, err)
	}
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(session, got); err != nil || string(got) != payload {
		t.Fatalf("exec session, %s: read %q, %v", payload, got, err)
	}
}

// TestRotationCA: a CA appended to the bundle (overlap), then the server
// moves to a certificate from the new CA; and a CA replaced outright after
// the server moved.
func TestRotationCA(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	newCA, err := testserver.NewCA("new-ca")
	must(t, err)
	for _, overlap := range []bool{true, false} {
		t.Run(fmt.Sprintf("overlap=%v", overlap), func(t *testing.T) {
			srv, err := testserver.Start(testserver.Options{CA: f.ca})
			must(t, err)
			defer func() { srv.Close() }()
			p := newPool(t, WithPollInterval(0))
			d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
			cfg := d.config(srv.URL())
			must(t, p.Wrap(cfg))
			must(t, listNodes(context.Background(), cfg))
			if overlap {
				d.write(t, f.alice, append(f.ca.CertPEM(), newCA.CertPEM()...))
				waitFor(t, "bundle reloaded", func() bool { return p.Stats().Rotations == 1 })
			}
			// The server moves to a serving certificate from the new CA,
			// on the same address, still trusting the old CA for clients.
			addr := srv.Addr()
			serving, err := newCA.IssueServer()
			must(t, err)
			srv.Close()
			srv, err = testserver.Start(testserver.Options{Addr: addr, CA: newCA, ServerCert: serving, ClientCAs: f.ca.Pool()})
			must(t, err)
			if overlap {
				if err := listNodes(context.Background(), cfg); err != nil {
					t.Fatalf("with both CAs in the bundle: %v", err)
				}
				return
			}
			if err := listNodes(context.Background(), cfg); err == nil {
				t.Fatal("the old CA verified the new server")
			}
			d.write(t, f.alice, newCA.CertPEM())
			waitFor(t, "requests recover once the CA file is updated", func() bool {
				return listNodes(context.Background(), cfg) == nil
			})
		})
	}
}

// TestRotationUnderLoad: at 50+ requests per second through one client, 10
// rotations lose no request, and each new certificate reaches the server.
func TestRotationUnderLoad(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := newPool(t, WithPollInterval(0), WithDrainTimeout(time.Second))
	d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	_, cs := d.wrapped(t, p, f.srv.URL())
	stop := make(chan struct{})
	reqs, fails, done := requestLoop(cs, 60, stop)
	var latencies []time.Duration
	for i := range 10 {
		cn := fmt.Sprintf("rotated-%d", i)
		kp, err := f.ca.IssueClient(cn)
		must(t, err)
		d.write(t, kp, f.ca.CertPEM())
		written := time.Now()
		waitFor(t, "the server sees "+cn, func() bool {
			_, ok := rec.firstSince(cn, written)
			return ok
		})
		at, _ := rec.firstSince(cn, written)
		latencies = append(latencies, at.Sub(written))
	}
	close(stop)
	<-done
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	t.Logf("%d requests, %d failed, 10 rotations; write-to-server latency median %v, worst %v",
		reqs.Load(), fails.Load(), latencies[5].Round(time.Millisecond), latencies[9].Round(time.Millisecond))
	if fails.Load() != 0 {
		t.Errorf("%d of %d requests failed", fails.Load(), reqs.Load())
	}
	// The counter goes up just after the new material is in use, so the
	// last certificate may reach the server first.
	waitFor(t, "the last rotation counted", func() bool { return p.Stats().Rotations >= 10 })
	if st := p.Stats(); st.Rotations != 10 {
		t.Errorf("Rotations = %d, want 10", st.Rotations)
	}
}

// createLoop creates config maps named after prefix through cs, one at a
// time, until stop is closed; it returns the number of requests and
// failures. The test server answers a create 405 (it stores nothing): an
// answer, not a failure; a failure is a request the server never answered.
func createLoop(cs kubernetes.Interface, prefix string, stop <-chan struct{}) (reqs, fails *atomic.Int64, done <-chan struct{}) {
	reqs, fails = &atomic.Int64{}, &atomic.Int64{}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("load-%s-%d", prefix, i)}}
			_, err := cs.CoreV1().ConfigMaps("default").Create(ctx, cm, metav1.CreateOptions{})
			cancel()
			reqs.Add(1)
			if err != nil && !apierrors.IsMethodNotSupported(err) {
				fails.Add(1)
			}
		}
	}()
	return reqs, fails, finished
}

// TestRotationCloseReleasesEverything: after Close no goroutine (goleak in
// TestMain) and no file descriptor of the pool remains.
func TestRotationCloseReleasesEverything(t *testing.T) {
	f := newFixture(t, testserver.Options{})
	before := countFDs(t)
	p := New(WithPollInterval(time.Second))
	for i := range 5 {
		d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
		cfg := d.config(f.srv.URL())
		cfg.UserAgent = fmt.Sprint(i)
		must(t, p.Wrap(cfg))
		must(t, listNodes(context.Background(), cfg))
	}
	must(t, p.Close())
	waitFor(t, "file descriptors back to the baseline", func() bool { return countFDs(t) <= before })
}

// logLines collects a pool's log messages.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() klog.Logger { return l.loggerAt(0) }

// loggerAt also collects messages logged at V(v) and below.
func (l *logLines) loggerAt(v int) klog.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		l.lines = append(l.lines, args)
		l.mu.Unlock()
	}, funcr.Options{Verbosity: v})
}

func (l *logLines) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, msg) {
			n++
		}
	}
	return n
}

// has reports whether one line holds every one of parts.
func (l *logLines) has(parts ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}

// TestWatcherSetsNoWatchAfterClose: a config wrapped while the pool closes
// (its entry is added to the file watcher after close) gets no new fsnotify
// watcher, which nothing would close.
func TestWatcherSetsNoWatchAfterClose(t *testing.T) {
	p := New(WithLogger(klog.Background().V(10)))
	w, err := p.reg.fileWatcher()
	must(t, err)
	must(t, p.Close())
	w.add(&stallingReloader{}, filepath.Join(t.TempDir(), "ca.crt"))
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.notify) != 0 {
		t.Fatal("the closed watcher made an fsnotify watcher")
	}
	for d, wd := range w.dirs {
		if wd.placing || wd.watch != nil {
			t.Errorf("%s: placing %v, watched %v after close", d, wd.placing, wd.watch != nil)
		}
	}
}

// TestRotationHalfFromFiles: a config that names only its CA as a file, or
// only its client certificate and key, has those files watched too. The
// server sees the rotated certificate, and requests recover once a CA file
// that did not verify the server is replaced.
func TestRotationHalfFromFiles(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	otherCA, err := testserver.NewCA("other-ca")
	must(t, err)
	ctx := context.Background()

	t.Run("certificate files, inline CA", func(t *testing.T) {
		p := newPool(t, WithPollInterval(0))
		d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
		cfg := d.config(f.srv.URL())
		cfg.CAFile, cfg.CAData = "", f.ca.CertPEM()
		must(t, p.Wrap(cfg))
		must(t, listNodes(ctx, cfg))
		d.write(t, f.bob, f.ca.CertPEM())
		written := time.Now()
		waitFor(t, "the server sees the rotated certificate", func() bool {
			_ = listNodes(ctx, cfg)
			_, ok := rec.firstSince("bob", written)
			return ok
		})
	})

	t.Run("CA file, inline certificate", func(t *testing.T) {
		p := newPool(t, WithPollInterval(0))
		d := newCertDir(t, secretVolume, f.alice, otherCA.CertPEM())
		cfg := d.config(f.srv.URL())
		cfg.CertFile, cfg.KeyFile = "", ""
		cfg.CertData, cfg.KeyData = f.carol.CertPEM, f.carol.KeyPEM
		// With a Proxy client-go builds a transport of its own for every
		// clientset, which reads the CA file anew: only the server's count
		// of connections tells the pool's transport from client-go's.
		cfg.Proxy = nilProxy
		listNodes := func(ctx context.Context, cfg *rest.Config) error { return listPooled(ctx, p, cfg) }
		start := time.Now()
		if err := listNodes(ctx, cfg); err == nil {
			t.Fatal("a CA that did not issue the server's certificate verified it")
		}
		d.write(t, f.alice, f.ca.CertPEM())
		waitFor(t, "requests recover once the CA file is replaced", func() bool {
			return listNodes(ctx, cfg) == nil
		})
		if _, ok := rec.firstSince("carol", start); !ok {
			t.Error("the server saw no request from carol")
		}
		// The pool's transport reads the CA file once its watch fired.
		waitFor(t, "the pool reloads the CA file", func() bool { return p.Stats().Rotations == 1 })
		f.srv.ResetStats()
		for range 3 {
			must(t, listNodes(ctx, cfg))
		}
		// At most the pool's new connection (it may be open already, from
		// the requests that waited for the reload): client-go's own
		// transport per clientset would make 3.
		if st := f.srv.Stats(); st.Accepted > 1 {
			t.Errorf("3 clientsets after the pool reloaded the CA file: server accepted %d connections, want at most 1 (the pool's new one)", st.Accepted)
		}
	})
}

// TestRotationPresentsNewCertificateAtOnce: right after the pool took rotated
// certificate files into use, a request through the same config presents the
// new certificate, although client-go's own transport for those files still
// holds the old one for a moment: the pool knows that transport as client-go's
// cached one for the files (no Proxy, no Dial), so the request goes over the
// pool's current transport rather than client-go's.
func TestRotationPresentsNewCertificateAtOnce(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := newPool(t, WithPollInterval(0))
	d := newCertDir(t, secretVolume, f.alice, f.ca.CertPEM())
	cfg, cs := d.wrapped(t, p, f.srv.URL())
	ctx := context.Background()
	if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	d.write(t, f.bob, f.ca.CertPEM())
	waitFor(t, "the pool takes the new files into use", func() bool { return p.Stats().Rotations == 1 })
	rotated := time.Now()
	for _, c := range []kubernetes.Interface{cs, mustClientset(t, cfg)} {
		if _, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	seen := rec.cnsSince(rotated)
	if seen["bob"] != 2 || len(seen) != 1 {
		t.Errorf("after the rotation the server saw requests from %v, want 2 from bob", seen)
	}
}

// listPooled lists nodes through a clientset for cfg over p.HTTPClientFor.
func listPooled(ctx context.Context, p *Pool, cfg *rest.Config) error {
	cs, err := pooledClientset(p, cfg)
	if err != nil {
		return err
	}
	_, err = cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	return err
}

// mustPooled is a clientset for cfg over p.HTTPClientFor.
func mustPooled(t testing.TB, p *Pool, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	cs, err := pooledClientset(p, cfg)
	must(t, err)
	return cs
}

func listNodesOf(t testing.TB, cs kubernetes.Interface) {
	t.Helper()
	if _, err := cs.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
}

func mustClientset(t testing.TB, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	return cs
}

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
	must(t, err)
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
	must(t, err)
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
