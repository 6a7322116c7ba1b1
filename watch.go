// Watching an identity's files: the pool watches the directories of its
// identities' files (fsnotify, with polling as a fallback) and turns their
// events into debounced reloads, at most maxLoads at once. What a reload
// does is in rotation.go; reading and validating material in material.go.

package sharedtransport

import (
	"errors"
	"fmt"
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

// maxLoads bounds the reloads in flight at once: a poll of thousands of
// identities does not start thousands of reads, and a few identities on a
// hung file system leave slots for the others.
const maxLoads = 4

// maxEventWait bounds how long events that keep coming put a reload off: a
// file written to without pause is still read.
const maxEventWait = 500 * time.Millisecond

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
	pool      *Pool
	notifyOff bool                // test seam: no file events at all, and no fallback
	done      chan struct{}       // closed by close: the run goroutine and reloads stop
	exited    chan struct{}       // closed when the run goroutine has exited
	wake      chan struct{}       // look again: a directory may miss its watch, or file events became available
	loaded    chan *identityWatch // a reload finished
	loads     sync.WaitGroup      // reloads in flight

	closeOnce sync.Once
	closeErr  error // what closing notify returned; set once, by close

	// mu guards the fields below, and the paths, dirs and stopped of every
	// identityWatch.
	mu         sync.Mutex
	notify     *fsnotify.Watcher // nil while the kernel refuses an inotify instance, or when notifyOff
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
		if w.closing() {
			return // no new watches
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
// After close began it sets none: close closes notify under w.mu once the
// run goroutine has exited, so a watcher made later would never be closed.
func (w *fileWatcher) watchLocked(d string, wd *watchedDir) {
	if w.closing() {
		return
	}
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
// stuck in the kernel is not waited for (see fileReader). Every call, the
// first and any later or concurrent one, returns once the watcher has
// stopped, with what closing its fsnotify watcher returned.
func (w *fileWatcher) close() error {
	w.closeOnce.Do(func() {
		close(w.done)
		<-w.exited
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.notify != nil {
			w.closeErr = w.notify.Close()
		}
	})
	return w.closeErr
}

// closing reports whether close has begun: no new watch is set from then on.
func (w *fileWatcher) closing() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
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
			w.onWatchError(err)
		case <-debounce.C:
			w.onDebounce()
			w.armDebounce(debounce)
		case iw := <-w.loaded:
			w.onLoaded(iw)
		case <-poll:
			w.onPoll()
		case <-fallback.C:
			fallbackArmed = false
			w.onFallback()
		}
		w.dispatch()
	}
}

// onWatchError queues a reload of every identity after an error from
// fsnotify: typically a queue overflow, so events were lost.
func (w *fileWatcher) onWatchError(err error) {
	w.pool.opts.logger.Info("File watch error; re-reading every watched file", "err", err)
	w.enqueueAll(true)
}

// onPoll queues a reload of every identity, and notes the directories whose
// watch the kernel dropped.
func (w *fileWatcher) onPoll() {
	w.mu.Lock()
	w.checkLocked()
	w.mu.Unlock()
	w.enqueueAll(false)
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
// debounce, or when the first event is maxEventWait old, whichever comes first,
// so a file written to without pause is still read.
func (w *fileWatcher) due(iw *identityWatch) time.Time {
	opts := &w.pool.opts
	quiet, latest := iw.last.Add(opts.debounce), iw.first.Add(maxEventWait)
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
