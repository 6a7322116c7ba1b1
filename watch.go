// Watching an identity's files: the pool watches the directories of its
// identities' files (fsnotify) and turns their events and polls into
// debounced reloads, at most maxLoads at once. Where the files lie is in
// watchpaths.go, polling what the kernel will not watch in watchpoll.go,
// what a reload does in rotation.go, reading and validating material in
// material.go.

package sharedtransport

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
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

// fileWatcher watches the directories of every file the pool's identities
// read, with one fsnotify watcher and one goroutine per pool. Directories,
// not files, are watched: kubelet updates secret volumes by swapping the
// "..data" symlink, and editors and cert managers rename over files, and a
// watch on the old file would see neither. Events for other files in those
// directories are ignored.
type fileWatcher struct {
	pool      *Pool
	notifyOff bool           // test seam: no file events at all, and no fallback
	done      chan struct{}  // closed by close: the run goroutine and reloads stop
	exited    chan struct{}  // closed when the run goroutine has exited
	wake      chan struct{}  // look again: a directory may miss its watch, or file events became available
	slots     chan struct{}  // one per reload reading files; at most maxLoads
	loads     sync.WaitGroup // reloads in flight or waiting for a slot

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

	pending map[*identityWatch]struct{} // events seen, reload not yet due; owned by the run goroutine
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
	queued    atomic.Bool // a reload is due and has not started
	resolve   atomic.Bool // the next reload follows an event: look up the paths again

	first, last time.Time // first and latest event of a pending reload; owned by the run goroutine
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
		slots:     make(chan struct{}, maxLoads),
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
		case <-poll:
			w.onPoll()
		case <-fallback.C:
			fallbackArmed = false
			w.onFallback()
		}
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
	return slices.Collect(maps.Keys(w.watches))
}

func (w *fileWatcher) enqueueAll(resolve bool) {
	for _, iw := range w.all() {
		w.enqueue(iw, resolve)
	}
}

// enqueue asks for a reload of iw; resolve asks it to look up its paths
// again. A reload asked for while one is due is that one; one asked for
// while one runs follows it (entry.files serializes them).
func (w *fileWatcher) enqueue(iw *identityWatch, resolve bool) {
	if resolve {
		iw.resolve.Store(true)
	}
	if !iw.queued.CompareAndSwap(false, true) {
		return
	}
	w.loads.Add(1)
	go func() {
		defer w.loads.Done()
		select {
		case w.slots <- struct{}{}:
		case <-w.done:
			return
		}
		defer func() { <-w.slots }()
		iw.queued.Store(false)
		iw.reload(iw.resolve.Swap(false))
	}()
}
