package sharedtransport

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

const (
	// maxMaterialFile bounds what is read of a certificate, key or CA file.
	// A bundle of every public root CA is about 250 KB; a file far larger is
	// not TLS material (a log, a disk image) and is not read to its end.
	maxMaterialFile = 4 << 20

	// clockSkew is how far in the future a certificate's NotBefore may lie
	// and still be taken: this machine's clock may run behind the signer's.
	// kube-controller-manager backdates the certificates it signs by the same
	// amount.
	clockSkew = 5 * time.Minute

	// maxLoads bounds the reloads in flight at once: a poll of thousands of
	// identities does not start thousands of reads, and a few identities on
	// a hung file system leave slots for the others.
	maxLoads = 4
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
// data included, so that a handshake never sees a torn, mismatched or
// out-of-date pair. Errors name the file and say what is wrong, never what it
// holds.
func (p *Pool) loadMaterial(id *identity) (*material, error) {
	m, err := p.readMaterial(id, nil)
	if err != nil {
		return nil, err
	}
	if m, err = p.checkRead(id, m, p.opts.now(), nil); err != nil {
		return nil, err
	}
	return m, nil
}

// checkRead checks m, read from id's files, at now. The reads of a
// certificate and its key are not atomic: a writer swapping both (kubelet's
// ..data symlink) between them gives a torn pair, so a mismatch is read once
// more before it counts. It returns the material checked last, nil if the
// second read failed.
func (p *Pool) checkRead(id *identity, m *material, now time.Time, done <-chan struct{}) (*material, error) {
	err := checkMaterial(id, m, now)
	if !errors.As(err, new(*pairError)) || id.certFile == "" {
		return m, err
	}
	if m, err = p.readMaterial(id, done); err != nil {
		return nil, err
	}
	return m, checkMaterial(id, m, p.opts.now())
}

// readMaterial reads id's files, without validating them, and takes its
// inline data as it is. The read is bounded: see fileReader.
func (p *Pool) readMaterial(id *identity, done <-chan struct{}) (*material, error) {
	m := &material{caPEM: id.caData, certPEM: id.certData, keyPEM: id.keyData}
	files := make([]fileToRead, 0, 3)
	if id.caFile != "" {
		files = append(files, fileToRead{id.caFile, "CA", &m.caPEM})
	}
	if id.certFile != "" {
		files = append(files, fileToRead{id.certFile, "client certificate", &m.certPEM}, fileToRead{id.keyFile, "client key", &m.keyPEM})
	}
	if len(files) == 0 {
		return m, nil
	}
	if err := p.reader.read(p.opts.readTimeout, done, files); err != nil {
		return nil, err
	}
	return m, nil
}

// pairError is a certificate and key that do not form a valid pair.
type pairError struct{ msg string }

func (e *pairError) Error() string { return e.msg }

// notYetValidError is material that becomes valid later, at from.
type notYetValidError struct {
	err  error
	from time.Time
}

func (e *notYetValidError) Error() string { return e.err.Error() }
func (e *notYetValidError) Unwrap() error { return e.err }

// checkMaterial validates m, id's material, at now: a CA bundle that can
// verify a server, and a certificate that matches its key and is valid now.
func checkMaterial(id *identity, m *material, now time.Time) error {
	if len(m.caPEM) > 0 {
		if err := checkCABundle(m.caPEM, now); err != nil {
			return fmt.Errorf("sharedtransport: %s: %w", describe(id.caFile, "inline CA data"), err)
		}
	}
	if len(m.certPEM) == 0 && len(m.keyPEM) == 0 {
		return nil
	}
	cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
	if err != nil {
		return &pairError{fmt.Sprintf("sharedtransport: %s and %s do not form a valid pair (%v): check that the key belongs to the certificate and that neither is half-written",
			describe(id.certFile, "inline client certificate data"), describe(id.keyFile, "inline client key data"), err)}
	}
	leaf := cert.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return fmt.Errorf("sharedtransport: %s: %w", describe(id.certFile, "inline client certificate data"), err)
		}
	}
	if err := checkValidity(leaf, now); err != nil {
		err2 := fmt.Errorf("sharedtransport: client certificate %s %w", describe(id.certFile, "(inline data)"), err)
		var nyv *notYetValidError
		if errors.As(err, &nyv) {
			return &notYetValidError{err2, nyv.from}
		}
		return err2
	}
	return nil
}

// checkValidity reports a certificate outside its validity window at now.
// A NotBefore up to clockSkew ahead of now is accepted.
func checkValidity(c *x509.Certificate, now time.Time) error {
	window := fmt.Sprintf("valid from %s until %s", stamp(c.NotBefore), stamp(c.NotAfter))
	switch {
	case now.After(c.NotAfter):
		return fmt.Errorf("has expired (%s; it is %s here): write a current certificate", window, stamp(now))
	case now.Add(clockSkew).Before(c.NotBefore):
		return &notYetValidError{
			err:  fmt.Errorf("is not valid yet (%s; it is %s here, more than the %v of clock skew allowed): check the clocks of this machine and of the signer", window, stamp(now), clockSkew),
			from: c.NotBefore.Add(-clockSkew),
		}
	}
	return nil
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }

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

// readFile reads a regular file of at most maxMaterialFile bytes. Anything
// else is refused before it is read: a named pipe would wait for a writer, a
// device such as /dev/zero would never end.
func readFile(path, what string) ([]byte, error) {
	// O_NONBLOCK: opening a named pipe waits for a writer without it. It does
	// not change reads of regular files.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	switch mode := fi.Mode(); {
	case mode.IsDir():
		return nil, fmt.Errorf("sharedtransport: read %s file %q: is a directory", what, path)
	case !mode.IsRegular():
		return nil, fmt.Errorf("sharedtransport: %s file %q is %s, not a regular file: point the config at the file itself", what, path, fileKind(mode))
	case fi.Size() > maxMaterialFile:
		return nil, fmt.Errorf("sharedtransport: %s file %q holds %d bytes, more than the %d a certificate file may hold", what, path, fi.Size(), maxMaterialFile)
	}
	// The file may have grown since the stat: the limit holds for the read too.
	b, err := io.ReadAll(io.LimitReader(f, maxMaterialFile+1))
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	if len(b) > maxMaterialFile {
		return nil, fmt.Errorf("sharedtransport: %s file %q holds more than the %d bytes a certificate file may hold", what, path, maxMaterialFile)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, fmt.Errorf("sharedtransport: %s file %q is empty", what, path)
	}
	return b, nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	default:
		return "a special file"
	}
}

// fileReader reads TLS material for one pool. A read that does not return
// (a hung network mount, a FUSE daemon that does not answer) cannot be
// cancelled: it is left to finish on a goroutine of its own while its caller
// moves on, and its file is not read again until it has, so a hung file costs
// one goroutine and one thread, however often it is asked for.
type fileReader struct {
	mu    sync.Mutex            // guards stuck and every readCall's current and abandoned
	stuck map[string]*stuckRead // files whose read outlived its wait
}

type stuckRead struct {
	since time.Time
	reads int // abandoned reads of the file not returned yet
}

// fileToRead is one file of a read, and where its content goes.
type fileToRead struct {
	path, what string
	into       *[]byte
}

// readCall is the state one read shares with the goroutine doing it.
type readCall struct {
	current   int  // index of the file being read, -1 before the first
	abandoned bool // the caller stopped waiting
	err       error
	done      chan struct{}
}

// read reads files in order. It returns when they are read, when timeout has
// passed, or when done is closed (with ErrClosed), whichever comes first.
func (r *fileReader) read(timeout time.Duration, done <-chan struct{}, files []fileToRead) error {
	r.mu.Lock()
	for _, f := range files {
		if s, ok := r.stuck[f.path]; ok {
			r.mu.Unlock()
			return fmt.Errorf("sharedtransport: read %s file %q: an earlier read has not returned for %v (a hung network file system?)",
				f.what, f.path, time.Since(s.since).Round(time.Second))
		}
	}
	r.mu.Unlock()

	call := &readCall{current: -1, done: make(chan struct{})}
	go r.readAll(call, files)
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-call.done:
		return call.err
	case <-done:
		r.abandon(call, files)
		return ErrClosed
	case <-timer.C:
		i, finished := r.abandon(call, files)
		switch {
		case finished:
			return call.err
		case i < 0:
			return fmt.Errorf("sharedtransport: read %s file %q: not started after %v", files[0].what, files[0].path, timeout)
		}
		return fmt.Errorf("sharedtransport: read %s file %q: no answer after %v (a hung network file system?)", files[i].what, files[i].path, timeout)
	}
}

// abandon gives up waiting for call and marks the file it is reading as
// stuck. It returns that file's index, or finished if the read finished
// meanwhile.
func (r *fileReader) abandon(call *readCall, files []fileToRead) (i int, finished bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-call.done:
		return -1, true
	default:
	}
	call.abandoned = true
	if call.current < 0 {
		return -1, false
	}
	path := files[call.current].path
	if r.stuck == nil {
		r.stuck = map[string]*stuckRead{}
	}
	s := r.stuck[path]
	if s == nil {
		s = &stuckRead{since: time.Now()}
		r.stuck[path] = s
	}
	s.reads++
	return call.current, false
}

func (r *fileReader) readAll(call *readCall, files []fileToRead) {
	defer close(call.done)
	for i, f := range files {
		r.mu.Lock()
		if call.abandoned {
			r.mu.Unlock()
			return
		}
		call.current = i
		r.mu.Unlock()

		b, err := readFile(f.path, f.what)

		r.mu.Lock()
		abandoned := call.abandoned
		if abandoned {
			// It returned: the file may be read again.
			if s := r.stuck[f.path]; s != nil {
				if s.reads--; s.reads <= 0 {
					delete(r.stuck, f.path)
				}
			}
		}
		call.current = -1
		r.mu.Unlock()
		if abandoned {
			return
		}
		if err != nil {
			call.err = err
			return
		}
		*f.into = b
	}
}

// checkCABundle accepts what client-go accepts as a CA bundle (PEM blocks
// with any text around them; blocks that are not certificates, or do not
// parse, are skipped, as crypto/x509 skips them), as long as one of its
// certificates can verify a server now. Unlike client-go it rejects a torn
// block, a "-----BEGIN" without its "-----END": a CA file caught mid-write
// must not replace a good one.
func checkCABundle(b []byte, now time.Time) error {
	if line := tornBlock(b); line > 0 {
		return fmt.Errorf("holds an incomplete PEM block: the -----BEGIN on line %d has no -----END (a write in progress?)", line)
	}
	var (
		certs, verifiers, valid int
		other                   string
		parseErr                error
		lastExpiry, firstStart  time.Time
	)
	for rest := b; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" || len(block.Headers) != 0 {
			other = block.Type
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			parseErr = err
			continue
		}
		certs++
		if !canVerifyServers(cert) {
			continue
		}
		verifiers++
		switch {
		case now.After(cert.NotAfter):
			if cert.NotAfter.After(lastExpiry) {
				lastExpiry = cert.NotAfter
			}
		case now.Add(clockSkew).Before(cert.NotBefore):
			if firstStart.IsZero() || cert.NotBefore.Before(firstStart) {
				firstStart = cert.NotBefore
			}
		default:
			valid++
		}
	}
	switch {
	case certs == 0 && parseErr != nil:
		return fmt.Errorf("holds no certificate that parses: %w", parseErr)
	case certs == 0 && other != "":
		return fmt.Errorf("holds a %q PEM block where CA certificates are expected", other)
	case certs == 0:
		return errors.New("holds no PEM certificate")
	case verifiers == 0:
		return errors.New("holds no CA certificate for servers: none of its certificates allows server authentication, so it can verify no server (a client certificate, or a CA for clients only, in the CA file?)")
	case valid == 0 && firstStart.IsZero():
		return fmt.Errorf("holds no CA certificate valid now: every one has expired, the last at %s (it is %s here): write the current CA", stamp(lastExpiry), stamp(now))
	case valid == 0:
		return &notYetValidError{
			err: fmt.Errorf("holds no CA certificate valid now: the first becomes valid at %s (it is %s here, more than the %v of clock skew allowed)",
				stamp(firstStart), stamp(now), clockSkew),
			from: firstStart.Add(-clockSkew),
		}
	}
	return nil
}

// tornBlock returns the line of the first "-----BEGIN" in b that has no
// "-----END" before the next "-----BEGIN", or of a last block that the end of
// b cuts short (within its "-----END" line); 0 if there is none. A write in
// progress cuts a file at its end.
func tornBlock(b []byte) int {
	begin, end := []byte("-----BEGIN"), []byte("-----END")
	for off := 0; ; {
		i := bytes.Index(b[off:], begin)
		if i < 0 {
			return 0
		}
		start := off + i
		off = start + len(begin)
		stop := len(b)
		if next := bytes.Index(b[off:], begin); next >= 0 {
			stop = off + next
		}
		torn := !bytes.Contains(b[off:stop], end)
		if !torn && stop == len(b) {
			block, _ := pem.Decode(b[start:])
			torn = block == nil
		}
		if torn {
			return 1 + bytes.Count(b[:start], []byte("\n"))
		}
	}
}

// canVerifyServers reports whether cert can end a server's chain: as a CA or
// pinned directly (a self-signed serving certificate, which client-go takes
// as a root too), as long as its extended key usages allow server
// authentication. crypto/x509 holds every certificate of a chain, the root
// included, to its extended key usages, so a CA restricted to client
// authentication verifies no server.
func canVerifyServers(cert *x509.Certificate) bool {
	if len(cert.ExtKeyUsage) == 0 && len(cert.UnknownExtKeyUsage) == 0 {
		return true
	}
	for _, u := range cert.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageAny,
			// crypto/x509 takes the server-gated-crypto usages as server authentication.
			x509.ExtKeyUsageMicrosoftServerGatedCrypto, x509.ExtKeyUsageNetscapeServerGatedCrypto:
			return true
		}
	}
	return false
}

// readPaths returns the paths whose change changes what reading file gives:
// every symbolic link met on the way to it (kubelet's "tls.crt" and "..data")
// and the file it resolves to. Each lies in a directory free of links, the
// name inotify reports its events by.
func readPaths(file string) []string {
	var paths []string
	vol := filepath.VolumeName(file)
	resolved := vol + string(filepath.Separator)
	todo := splitPath(file[len(vol):])
	for links := 0; len(todo) > 0; {
		next := filepath.Join(resolved, todo[0])
		todo = todo[1:]
		fi, err := os.Lstat(next)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			resolved = next // missing parts are taken as they are named
			continue
		}
		paths = append(paths, next)
		target, err := os.Readlink(next)
		if links++; err != nil || links > 40 {
			resolved = next
			continue
		}
		if filepath.IsAbs(target) {
			vol = filepath.VolumeName(target)
			resolved = vol + string(filepath.Separator)
			target = target[len(vol):]
		}
		todo = append(splitPath(target), todo...)
	}
	return append(paths, resolved)
}

func splitPath(p string) []string {
	return strings.FieldsFunc(p, func(r rune) bool { return r == filepath.Separator || r == '/' })
}

// identityPaths returns the paths readPaths gives for each of id's files,
// without repeats.
func identityPaths(id *identity) []string {
	var paths []string
	for _, f := range []string{id.caFile, id.certFile, id.keyFile} {
		if f == "" {
			continue
		}
		for _, p := range readPaths(f) {
			if !slices.Contains(paths, p) {
				paths = append(paths, p)
			}
		}
	}
	return paths
}

// fileWatcher watches the directories of every file the pool's identities
// read, with one fsnotify watcher and one goroutine per pool. Directories,
// not files, are watched: kubelet updates secret volumes by swapping the
// "..data" symlink, and editors and cert managers rename over files, and a
// watch on the old file would see neither. Events for other files in those
// directories are ignored.
//
// When the kernel refuses an inotify instance or a watch (its per-user
// limits), the directories concerned are polled instead, every
// options.fallbackPoll, and the watch is tried again at the same time.
type fileWatcher struct {
	pool   *Pool
	done   chan struct{}
	exited chan struct{}
	wake   chan struct{}       // look again: a directory may miss its watch, or file events became available
	loaded chan *identityWatch // a reload finished
	loads  sync.WaitGroup      // reloads in flight

	mu         sync.Mutex        // guards the fields below, and the paths, dirs and stopped of every identityWatch
	notify     *fsnotify.Watcher // nil while the kernel refuses an inotify instance, or when notifyOff
	notifyOff  bool              // test seam: no file events at all, and no fallback
	dirs       map[string]*watchedDir
	byPath     map[string][]*identityWatch // the identities that read through a path
	watches    map[*identityWatch]struct{}
	unwatched  int  // dirs without a watch
	refusalLog bool // the refusal of a watch was logged; cleared when every directory has its watch again

	// Owned by the run goroutine.
	pending map[*identityWatch]struct{} // events seen, reload not yet due
	queue   []*identityWatch            // reloads due, waiting for a slot
	running int                         // reloads in flight
}

// watchedDir is one watched directory.
type watchedDir struct {
	refs    int  // identities with a path in it
	watched bool // its inotify watch is in place
}

// identityWatch is one entry's interest in its files.
type identityWatch struct {
	w *fileWatcher
	e *entry

	// Guarded by w.mu.
	paths, dirs []string
	stopped     bool

	lookingUp atomic.Bool // a relook is running

	// Owned by the run goroutine.
	first, last time.Time // first and latest event of a pending reload
	resolve     bool      // the next reload follows an event: look up the paths again
	queued      bool
	loading     bool
	again       bool // reload once more when the running reload ends

	// Owned by the reload in flight (one at a time).
	rejected *material // the last material rejected, so unchanged bad files are not parsed again
	retryAt  time.Time // when rejected becomes valid; zero: never
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
		pool:      p,
		done:      make(chan struct{}),
		exited:    make(chan struct{}),
		wake:      make(chan struct{}, 1),
		loaded:    make(chan *identityWatch),
		notifyOff: p.opts.disableNotify,
		dirs:      map[string]*watchedDir{},
		byPath:    map[string][]*identityWatch{},
		watches:   map[*identityWatch]struct{}{},
		pending:   map[*identityWatch]struct{}{},
	}
	if !w.notifyOff {
		// A refusal (fs.inotify.max_user_instances) is logged when the first
		// directory goes without its watch, and tried again from the poll.
		w.notify, _ = fsnotify.NewWatcher()
	}
	p.watcher = w
	go w.run()
	return w, nil
}

// add starts watching e's files.
func (w *fileWatcher) add(e *entry) *identityWatch {
	iw := &identityWatch{w: w, e: e}
	paths := identityPaths(e.id)
	w.mu.Lock()
	w.watches[iw] = struct{}{}
	w.setPathsLocked(iw, paths)
	missing := w.unwatched > 0
	w.mu.Unlock()
	if missing {
		w.poke()
	}
	return iw
}

// stop stops watching iw's files; a directory no identity needs any more is
// unwatched.
func (iw *identityWatch) stop() {
	w := iw.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if iw.stopped {
		return
	}
	iw.stopped = true
	delete(w.watches, iw)
	w.setPathsLocked(iw, nil)
}

// relook looks up again, on a goroutine of its own, the paths iw's files
// resolve through: after a kubelet ..data swap they lie in another
// directory. It does not wait: looking a path up on a network file system
// that stopped answering does not return, and a reload must end. One look
// at a time per identity.
func (iw *identityWatch) relook() {
	if !iw.lookingUp.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer iw.lookingUp.Store(false)
		paths := identityPaths(iw.e.id)
		w := iw.w
		w.mu.Lock()
		defer w.mu.Unlock()
		select {
		case <-w.done:
			return // closed: no new watches
		default:
		}
		if !iw.stopped && !slices.Equal(paths, iw.paths) {
			w.setPathsLocked(iw, paths)
		}
		if w.unwatched > 0 {
			w.poke()
		}
	}()
}

func (w *fileWatcher) setPathsLocked(iw *identityWatch, paths []string) {
	var dirs []string
	for _, p := range paths {
		if d := filepath.Dir(p); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	for _, p := range iw.paths {
		rest := slices.DeleteFunc(w.byPath[p], func(o *identityWatch) bool { return o == iw })
		if len(rest) == 0 {
			delete(w.byPath, p)
		} else {
			w.byPath[p] = rest
		}
	}
	for _, p := range paths {
		w.byPath[p] = append(w.byPath[p], iw)
	}
	for _, d := range dirs {
		if !slices.Contains(iw.dirs, d) {
			w.refDirLocked(d)
		}
	}
	for _, d := range iw.dirs {
		if !slices.Contains(dirs, d) {
			w.unrefDirLocked(d)
		}
	}
	iw.paths, iw.dirs = paths, dirs
}

func (w *fileWatcher) refDirLocked(d string) {
	wd := w.dirs[d]
	if wd == nil {
		wd = &watchedDir{}
		w.dirs[d] = wd
		if !w.notifyOff {
			w.unwatched++
			w.watchLocked(d, wd)
		}
	}
	wd.refs++
}

func (w *fileWatcher) unrefDirLocked(d string) {
	wd := w.dirs[d]
	if wd.refs--; wd.refs > 0 {
		return
	}
	delete(w.dirs, d)
	switch {
	case wd.watched:
		_ = w.notify.Remove(d) // the kernel drops the watch of a removed directory itself
	case !w.notifyOff:
		w.unwatched--
	}
	w.logRecoveryLocked()
}

// watchLocked asks the kernel to watch d, which has no watch yet.
func (w *fileWatcher) watchLocked(d string, wd *watchedDir) {
	var err error
	if w.notify == nil {
		if w.notify, err = fsnotify.NewWatcher(); err != nil {
			w.notify = nil
			w.logRefusalLocked(d, fmt.Errorf("no inotify instance: %w", err))
			return
		}
		w.poke() // the run goroutine takes the new watcher's events
	}
	if err = w.notify.Add(d); err != nil {
		w.logRefusalLocked(d, err)
		return
	}
	wd.watched = true
	w.unwatched--
	w.logRecoveryLocked()
}

func (w *fileWatcher) logRefusalLocked(d string, err error) {
	if w.refusalLog {
		return
	}
	w.refusalLog = true
	hint := ""
	switch {
	case errors.Is(err, syscall.EMFILE):
		hint = "raise fs.inotify.max_user_instances, or use fewer pools and inotify users"
	case errors.Is(err, syscall.ENOSPC):
		hint = "raise fs.inotify.max_user_watches"
	}
	w.pool.opts.logger.Info("File events unavailable for a watched directory; polling it instead until its watch can be set",
		"dir", d, "err", err.Error(), "pollInterval", w.pool.opts.fallbackPoll, "hint", hint)
}

func (w *fileWatcher) logRecoveryLocked() {
	if w.unwatched == 0 && w.refusalLog {
		w.refusalLog = false
		w.pool.opts.logger.Info("File events available again for every watched directory")
	}
}

// retryLocked tries again to watch every directory without its watch, and
// returns the identities whose files lie in a directory that had none: the
// poll reads them.
func (w *fileWatcher) retryLocked() []*identityWatch {
	if w.unwatched == 0 {
		return nil
	}
	var missing []string
	for d, wd := range w.dirs {
		if !wd.watched {
			missing = append(missing, d)
			w.watchLocked(d, wd)
		}
	}
	var out []*identityWatch
	for iw := range w.watches {
		if slices.ContainsFunc(iw.dirs, func(d string) bool { return slices.Contains(missing, d) }) {
			out = append(out, iw)
		}
	}
	return out
}

// checkLocked marks directories whose watch the kernel dropped without an
// event fsnotify passes on (an unmount) as unwatched.
func (w *fileWatcher) checkLocked() {
	if w.notify == nil {
		return
	}
	list := w.notify.WatchList()
	if len(list) == len(w.dirs)-w.unwatched {
		return
	}
	for d, wd := range w.dirs {
		if wd.watched && !slices.Contains(list, d) {
			wd.watched = false
			w.unwatched++
		}
	}
}

// unwatchedDirs is the number of directories watched by polling alone.
func (w *fileWatcher) unwatchedDirs() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.unwatched
}

func (w *fileWatcher) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// close stops the watcher and waits for its goroutine and its reloads. A read
// stuck in the kernel is not waited for (see fileReader).
func (w *fileWatcher) close() error {
	select {
	case <-w.done:
		<-w.exited
		return nil
	default:
	}
	close(w.done)
	<-w.exited
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.notify != nil {
		return w.notify.Close()
	}
	return nil
}

// run is the watcher's one goroutine: it turns file events into debounced
// reloads and polls, and hands them to at most maxLoads reload goroutines,
// one at a time per identity, so rotations of one identity never race each
// other and a slow one holds up no other.
func (w *fileWatcher) run() {
	defer close(w.exited)
	defer w.loads.Wait()
	opts := &w.pool.opts
	var poll <-chan time.Time
	if opts.pollInterval > 0 {
		t := time.NewTicker(opts.pollInterval)
		defer t.Stop()
		poll = t.C
	}
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	fallback := time.NewTimer(time.Hour)
	fallback.Stop()
	defer fallback.Stop()
	fallbackArmed := false

	var events <-chan fsnotify.Event
	var errs <-chan error
	var notify *fsnotify.Watcher
	for {
		w.mu.Lock()
		if w.notify != notify {
			notify = w.notify
			events, errs = notify.Events, notify.Errors
		}
		if !fallbackArmed && w.unwatched > 0 {
			fallback.Reset(opts.fallbackPoll)
			fallbackArmed = true
		}
		w.mu.Unlock()

		select {
		case <-w.done:
			return
		case <-w.wake:
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			w.onEvent(ev)
			w.armDebounce(debounce)
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			// Typically a queue overflow: events were lost, so look at everything.
			opts.logger.Info("File watch error; re-reading every watched file", "err", err)
			w.enqueueAll(true)
		case <-debounce.C:
			w.onDebounce()
			w.armDebounce(debounce)
		case iw := <-w.loaded:
			w.onLoaded(iw)
		case <-poll:
			w.mu.Lock()
			w.checkLocked()
			w.mu.Unlock()
			w.enqueueAll(false)
		case <-fallback.C:
			fallbackArmed = false
			w.onFallback()
		}
		w.dispatch()
	}
}

// onDebounce queues the pending reloads that are due.
func (w *fileWatcher) onDebounce() {
	now := time.Now()
	for iw := range w.pending {
		if !w.due(iw).After(now) {
			delete(w.pending, iw)
			iw.first, iw.last = time.Time{}, time.Time{}
			w.enqueue(iw, true)
		}
	}
}

// onLoaded frees the slot of a reload that ended, and queues it again if
// something changed while it ran.
func (w *fileWatcher) onLoaded(iw *identityWatch) {
	w.running--
	iw.loading = false
	if iw.again {
		iw.again = false
		w.enqueue(iw, false)
	}
}

// onFallback tries again to watch the directories without a watch, and
// queues a reload of the identities with files in them.
func (w *fileWatcher) onFallback() {
	w.mu.Lock()
	w.checkLocked()
	missed := w.retryLocked()
	w.mu.Unlock()
	for _, iw := range missed {
		w.enqueue(iw, false)
	}
}

// onEvent marks the identities that read through the event's path (or whose
// directory it is) for a reload, debounced: a burst of writes settles into
// one reload.
func (w *fileWatcher) onEvent(ev fsnotify.Event) {
	w.mu.Lock()
	iws := slices.Clone(w.byPath[ev.Name])
	if wd, ok := w.dirs[ev.Name]; ok {
		switch {
		case ev.Has(fsnotify.Remove | fsnotify.Rename):
			// A watched directory went away, and its watch with it.
			if wd.watched {
				wd.watched = false
				w.unwatched++
			}
		case ev.Has(fsnotify.Create) && !wd.watched:
			w.watchLocked(ev.Name, wd) // back: watch it at once
		}
		for iw := range w.watches {
			if slices.Contains(iw.dirs, ev.Name) {
				iws = append(iws, iw)
			}
		}
	}
	w.mu.Unlock()
	now := time.Now()
	for _, iw := range iws {
		if iw.first.IsZero() {
			iw.first = now
			w.pending[iw] = struct{}{}
		}
		iw.last = now
	}
}

// due is when a pending reload starts: when events have been quiet for the
// debounce, or when the first event is maxWait old, whichever comes first,
// so a file written to without pause is still read.
func (w *fileWatcher) due(iw *identityWatch) time.Time {
	opts := &w.pool.opts
	quiet, latest := iw.last.Add(opts.debounce), iw.first.Add(opts.maxWait)
	if latest.Before(quiet) {
		return latest
	}
	return quiet
}

func (w *fileWatcher) armDebounce(t *time.Timer) {
	var next time.Time
	for iw := range w.pending {
		if d := w.due(iw); next.IsZero() || d.Before(next) {
			next = d
		}
	}
	if next.IsZero() {
		t.Stop()
		return
	}
	t.Reset(time.Until(next))
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

func (w *fileWatcher) enqueueAll(resolve bool) {
	for _, iw := range w.all() {
		w.enqueue(iw, resolve)
	}
}

// enqueue asks for a reload of iw; resolve asks it to look up its paths again.
func (w *fileWatcher) enqueue(iw *identityWatch, resolve bool) {
	iw.resolve = iw.resolve || resolve
	switch {
	case iw.loading:
		iw.again = true
	case !iw.queued:
		iw.queued = true
		w.queue = append(w.queue, iw)
	}
}

// dispatch starts queued reloads while slots are free.
func (w *fileWatcher) dispatch() {
	for w.running < maxLoads && len(w.queue) > 0 {
		iw := w.queue[0]
		w.queue[0] = nil
		w.queue = w.queue[1:]
		iw.queued = false
		if iw.e.closed.Load() {
			continue
		}
		iw.loading = true
		w.running++
		resolve := iw.resolve
		iw.resolve = false
		w.loads.Add(1)
		go func() {
			defer w.loads.Done()
			iw.reload(resolve)
			select {
			case w.loaded <- iw:
			case <-w.done:
			}
		}()
	}
	if len(w.queue) == 0 {
		w.queue = nil // let the backing array go after a poll of many identities
	}
}

// reload re-reads the identity's files. Unchanged bytes are no reload, and
// cost a read and a comparison. Invalid material keeps the last good one and
// is counted once; the next event or poll looks again. Valid new material is
// taken into use at once.
func (iw *identityWatch) reload(resolve bool) {
	w, e := iw.w, iw.e
	p := w.pool
	if e.closed.Load() {
		return
	}
	if resolve {
		defer iw.relook()
	}
	// Every poll and event looks at the expiry of the certificate in use:
	// when no newer file arrives, that is the certificate that expires.
	defer e.checkExpiry()
	m, err := p.readMaterial(e.id, w.done)
	if errors.Is(err, ErrClosed) {
		return
	}
	if err != nil {
		iw.keep(err)
		return
	}
	if m.equal(e.current.Load().material) {
		iw.rejected = nil
		e.filesBad.Store(false)
		return
	}
	now := p.opts.now()
	if iw.rejected != nil && m.equal(iw.rejected) && (iw.retryAt.IsZero() || now.Before(iw.retryAt)) {
		return // rejected already, and counted
	}
	if !resolve {
		defer iw.relook() // new content: the files may lie elsewhere now
	}
	if m, err = p.checkRead(e.id, m, now, w.done); errors.Is(err, ErrClosed) {
		return
	}
	if err != nil {
		iw.rejected, iw.retryAt = m, time.Time{}
		if nyv := new(notYetValidError); errors.As(err, &nyv) {
			iw.retryAt = nyv.from
		}
		iw.keep(err)
		return
	}
	iw.rejected = nil
	if m.equal(e.current.Load().material) {
		return
	}
	g, err := p.newGeneration(e, m)
	if err != nil {
		iw.keep(err)
		return
	}
	if e.rotate(g, p.opts.drainTimeout) {
		e.filesBad.Store(false)
		p.stats.rotations.Add(1)
		e.stats.rotations.Add(1)
		p.opts.logger.V(2).Info("Rotated TLS material", "identity", e.id.key, "files", []string{e.id.caFile, e.id.certFile, e.id.keyFile})
	}
}

// keep counts and logs a rejected reload; the last good material stays.
func (iw *identityWatch) keep(err error) {
	p := iw.w.pool
	iw.e.filesBad.Store(true)
	p.stats.rotationErrors.Add(1)
	msg := iw.e.recordReloadError(err, p.opts.now())
	p.opts.logger.Info("Keeping the last good TLS material", "identity", iw.e.id.key, "reason", msg)
}
