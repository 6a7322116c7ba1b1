package sharedtransport

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
)

// material is one version of an identity's TLS material: what a generation
// of its transport hands out in handshakes.
type material struct {
	caPEM, certPEM, keyPEM []byte
}

func (m *material) equal(o *material) bool {
	return bytes.Equal(m.caPEM, o.caPEM) && bytes.Equal(m.certPEM, o.certPEM) && bytes.Equal(m.keyPEM, o.keyPEM)
}

// loadMaterial reads an identity's files and validates everything, inline
// data included, so that a handshake never sees a torn or mismatched pair.
// Errors name the file and say what is wrong, never what it holds.
func loadMaterial(id *identity) (*material, error) {
	m := &material{caPEM: id.caData, certPEM: id.certData, keyPEM: id.keyData}
	var err error
	if id.caFile != "" {
		if m.caPEM, err = readFile(id.caFile, "CA"); err != nil {
			return nil, err
		}
	}
	if id.certFile != "" {
		if m.certPEM, m.keyPEM, err = readPair(id.certFile, id.keyFile); err != nil {
			return nil, err
		}
	}

	if len(m.caPEM) > 0 {
		if err := checkCABundle(m.caPEM); err != nil {
			return nil, fmt.Errorf("sharedtransport: %s: %w", describe(id.caFile, "inline CA data"), err)
		}
	}
	if len(m.certPEM) > 0 || len(m.keyPEM) > 0 {
		if _, err := tls.X509KeyPair(m.certPEM, m.keyPEM); err != nil {
			return nil, fmt.Errorf("sharedtransport: %s and %s do not form a valid pair (%v): check that the key belongs to the certificate and that neither is half-written",
				describe(id.certFile, "inline client certificate data"), describe(id.keyFile, "inline client key data"), err)
		}
	}
	return m, nil
}

// readPair reads a certificate and key file. The two reads are not atomic:
// a writer swapping both (kubelet's ..data symlink) between them gives a
// torn pair, so a mismatch is read once more before it counts.
func readPair(certFile, keyFile string) (certPEM, keyPEM []byte, err error) {
	for attempt := 0; ; attempt++ {
		if certPEM, err = readFile(certFile, "client certificate"); err != nil {
			return nil, nil, err
		}
		if keyPEM, err = readFile(keyFile, "client key"); err != nil {
			return nil, nil, err
		}
		if _, err := tls.X509KeyPair(certPEM, keyPEM); err == nil || attempt == 1 {
			return certPEM, keyPEM, nil // loadMaterial reports a pair that still fails
		}
	}
}

func describe(file, inline string) string {
	if file == "" {
		return inline
	}
	return fmt.Sprintf("file %q", file)
}

// dataOrFile returns inline data, or the content of file when there is none:
// client-go's rule for material it does not reload.
func dataOrFile(data []byte, file, what string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	return readFile(file, what)
}

func readFile(path, what string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, fmt.Errorf("sharedtransport: %s file %q is empty", what, path)
	}
	return b, nil
}

// checkCABundle accepts PEM certificates only, and rejects a bundle that ends
// in a torn block: a CA file caught mid-write must not replace a good one.
func checkCABundle(b []byte) error {
	n, verifiers := 0, 0
	rest := b
	for {
		block, r := pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return fmt.Errorf("holds a %q PEM block where CA certificates are expected", block.Type)
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return fmt.Errorf("certificate %d does not parse: %w", n+1, err)
		}
		if canVerifyServers(cert) {
			verifiers++
		}
		n++
		rest = r
	}
	if n == 0 {
		return errors.New("holds no PEM certificate")
	}
	if verifiers == 0 {
		return errors.New("holds no CA certificate: none of its certificates is a CA or usable for server authentication, so it can verify no server (a client certificate in the CA file?)")
	}
	if len(bytes.TrimSpace(rest)) > 0 {
		return errors.New("ends in an incomplete PEM block (a write in progress?)")
	}
	return nil
}

// canVerifyServers reports whether cert can anchor a server's chain: a CA,
// or a certificate pinned directly (self-signed server certificates, which
// client-go accepts as roots too).
func canVerifyServers(cert *x509.Certificate) bool {
	if cert.BasicConstraintsValid && cert.IsCA || len(cert.ExtKeyUsage) == 0 {
		return true
	}
	for _, u := range cert.ExtKeyUsage {
		if u == x509.ExtKeyUsageServerAuth || u == x509.ExtKeyUsageAny {
			return true
		}
	}
	return false
}

// fileWatcher watches the directories of every file the pool's identities
// name, with one fsnotify watcher and one goroutine per pool. Directories,
// not files, are watched: kubelet updates secret volumes by swapping the
// "..data" symlink, and editors and cert managers rename over files, and a
// watch on the old file would see neither.
type fileWatcher struct {
	pool    *Pool
	notify  *fsnotify.Watcher // nil when the notify path is off (test seam)
	done    chan struct{}
	exited  chan struct{}
	changed chan struct{} // a watch was added or removed

	mu      sync.Mutex // guards dirs and watches
	dirs    map[string]int
	watches map[*identityWatch]struct{}
}

// identityWatch is one entry's interest in its files.
type identityWatch struct {
	w    *fileWatcher
	e    *entry
	dirs []string
}

func (p *Pool) fileWatcher() (*fileWatcher, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if p.watcher != nil {
		return p.watcher, nil
	}
	w := &fileWatcher{
		pool:    p,
		done:    make(chan struct{}),
		exited:  make(chan struct{}),
		changed: make(chan struct{}, 1),
		dirs:    map[string]int{},
		watches: map[*identityWatch]struct{}{},
	}
	if !p.opts.disableNotify {
		n, err := fsnotify.NewWatcher()
		if err != nil {
			return nil, fmt.Errorf("sharedtransport: watch certificate files: %w", err)
		}
		w.notify = n
	}
	p.watcher = w
	go w.run()
	return w, nil
}

// watchedDirs returns the directories whose changes can change id's files:
// the directory of each path, and of the file a symlink resolves to.
func watchedDirs(id *identity) []string {
	seen := map[string]bool{}
	var dirs []string
	for _, f := range []string{id.caFile, id.certFile, id.keyFile} {
		if f == "" {
			continue
		}
		cands := []string{filepath.Dir(f)}
		if real, err := filepath.EvalSymlinks(f); err == nil {
			cands = append(cands, filepath.Dir(real))
		}
		for _, d := range cands {
			if !seen[d] {
				seen[d] = true
				dirs = append(dirs, d)
			}
		}
	}
	return dirs
}

func (w *fileWatcher) add(e *entry) (*identityWatch, error) {
	iw := &identityWatch{w: w, e: e, dirs: watchedDirs(e.id)}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range iw.dirs {
		if w.dirs[d] == 0 && w.notify != nil {
			if err := w.notify.Add(d); err != nil {
				w.removeDirsLocked(iw.dirs[:slices.Index(iw.dirs, d)])
				return nil, fmt.Errorf("sharedtransport: watch directory %q: %w", d, err)
			}
		}
		w.dirs[d]++
	}
	w.watches[iw] = struct{}{}
	return iw, nil
}

func (w *fileWatcher) removeDirsLocked(dirs []string) {
	for _, d := range dirs {
		w.dirs[d]--
		if w.dirs[d] <= 0 {
			delete(w.dirs, d)
			if w.notify != nil {
				_ = w.notify.Remove(d) // the directory may be gone already
			}
		}
	}
}

// stop removes iw; a directory no identity needs any more is unwatched.
func (iw *identityWatch) stop() {
	w := iw.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.watches[iw]; !ok {
		return
	}
	delete(w.watches, iw)
	w.removeDirsLocked(iw.dirs)
}

// close stops the watcher and waits for its goroutine to exit.
func (w *fileWatcher) close() error {
	select {
	case <-w.done:
		<-w.exited
		return nil
	default:
	}
	close(w.done)
	<-w.exited
	if w.notify != nil {
		return w.notify.Close()
	}
	return nil
}

// watchesIn returns the identities with files in dir.
func (w *fileWatcher) watchesIn(dir string) []*identityWatch {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*identityWatch
	for iw := range w.watches {
		for _, d := range iw.dirs {
			if d == dir {
				out = append(out, iw)
				break
			}
		}
	}
	return out
}

func (w *fileWatcher) all() []*identityWatch {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]*identityWatch, 0, len(w.watches))
	for iw := range w.watches {
		out = append(out, iw)
	}
	return out
}

// run is the watcher's one goroutine: it turns file events into debounced
// reloads, and polls. Reloads run here, one at a time, so rotations of one
// identity never race each other.
func (w *fileWatcher) run() {
	defer close(w.exited)
	opts := &w.pool.opts
	var events <-chan fsnotify.Event
	var errs <-chan error
	if w.notify != nil {
		events, errs = w.notify.Events, w.notify.Errors
	}
	var poll <-chan time.Time
	if opts.pollInterval > 0 {
		t := time.NewTicker(opts.pollInterval)
		defer t.Stop()
		poll = t.C
	}
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	pending := map[*identityWatch]bool{}

	for {
		select {
		case <-w.done:
			return
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			for _, iw := range w.watchesIn(filepath.Dir(ev.Name)) {
				pending[iw] = true
			}
			if len(pending) > 0 {
				debounce.Reset(opts.debounce) // a burst of writes settles into one reload
			}
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			// Typically a queue overflow: events were lost, so look at everything.
			opts.logger.Info("File watch error; re-reading every watched file", "err", err)
			for _, iw := range w.all() {
				pending[iw] = true
			}
			debounce.Reset(opts.debounce)
		case <-debounce.C:
			for iw := range pending {
				iw.reload()
			}
			clear(pending)
		case <-poll:
			for _, iw := range w.all() {
				iw.rewatch()
				iw.reload()
			}
		}
	}
}

// rewatch re-adds the identity's directories to fsnotify: a directory that
// was deleted and created again lost its watch.
func (iw *identityWatch) rewatch() {
	w := iw.w
	if w.notify == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range iw.dirs {
		_ = w.notify.Add(d) // adding a watched directory again is harmless
	}
}

// reload re-reads the identity's files. Unchanged bytes are no reload. Invalid
// material keeps the last good one and is counted; the next event or poll
// tries again. Valid new material is taken into use at once.
func (iw *identityWatch) reload() {
	e := iw.e
	p := iw.w.pool
	if e.closed.Load() {
		return
	}
	m, err := loadMaterial(e.id)
	if err != nil {
		p.stats.rotationErrors.Add(1)
		p.opts.logger.Info("Keeping the last good TLS material", "identity", e.id.key, "reason", err.Error())
		return
	}
	if m.equal(e.current.Load().material) {
		return
	}
	g, err := p.newGeneration(e, m)
	if err != nil {
		p.stats.rotationErrors.Add(1)
		p.opts.logger.Info("Keeping the last good TLS material", "identity", e.id.key, "reason", err.Error())
		return
	}
	if e.rotate(g, p.opts.drainTimeout) {
		p.stats.rotations.Add(1)
		p.opts.logger.V(2).Info("Rotated TLS material", "identity", e.id.key, "files", []string{e.id.caFile, e.id.certFile, e.id.keyFile})
	}
}
