// Watching an identity's files: the pool watches the directory of every file
// its identities read (fsnotify), and turns events, polls and the fallback for
// directories the kernel will not watch into reloads, run by a few workers
// from one workqueue. What a reload does is in rotation.go; reading and
// validating material in material.go.

package sharedtransport

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"k8s.io/client-go/util/workqueue"
)

// maxLoads is the number of workers running reloads: a poll of thousands of
// identities does not start thousands of reads, and an identity on a hung
// file system leaves the others workers to run on.
const maxLoads = 4

// fileWatcher watches the directories of the files the pool's identities
// read, with one fsnotify watcher and one goroutine per pool. Directories,
// not files, are watched: kubelet updates a secret volume by swapping the
// "..data" symlink beside the file names a config holds, and editors and
// certificate managers rename new files over old ones; a watch on the file
// would see neither. Any event in a directory reloads, after the debounce,
// every identity with a file there: files that did not change cost a read and
// a comparison. A file that is a link into another directory is followed by
// the poll.
type fileWatcher struct {
	pool *Pool
	// queue holds the identities due a reload. An identity is in it once
	// however often it is added, and a reload asked for while one runs
	// follows it, so reloads of one identity never race each other.
	queue   *workqueue.Typed[*identityWatch]
	done    chan struct{}  // closed by close: the goroutines and reads stop
	running sync.WaitGroup // the run goroutine and the workers

	closeOnce sync.Once
	closeErr  error // what closing notify returned

	// mu guards the fields below and every identityWatch's stopped.
	mu            sync.Mutex
	notify        *fsnotify.Watcher // nil while the kernel refuses an inotify instance, or with disableNotify
	notifyChanged chan struct{}     // the run goroutine takes a new notify's events
	dirs          map[string]*watchedDir
	unwatched     int  // dirs without their watch, polled every fallbackPoll
	refusalLogged bool // cleared when every directory has its watch again
}

// watchedDir is a directory holding files of the identities in it.
type watchedDir struct {
	identities map[*identityWatch]struct{}
	watched    bool // its inotify watch is in place
}

// identityWatch is one entry's interest in its files.
type identityWatch struct {
	w       *fileWatcher
	e       *entry
	dirs    []string    // the directories of the entry's files
	stopped bool        // guarded by w.mu
	due     atomic.Bool // a debounced reload is on its way to the queue
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
		pool:          p,
		queue:         workqueue.NewTyped[*identityWatch](),
		done:          make(chan struct{}),
		notifyChanged: make(chan struct{}, 1),
		dirs:          map[string]*watchedDir{},
	}
	if !p.opts.disableNotify {
		// A refusal (fs.inotify.max_user_instances) is logged when the first
		// directory goes without its watch, and tried again by the fallback.
		w.notify, _ = fsnotify.NewWatcher()
	}
	p.watcher = w
	w.running.Add(1 + maxLoads)
	go w.run()
	for range maxLoads {
		go w.work()
	}
	return w, nil
}

// add starts watching e's files.
func (w *fileWatcher) add(e *entry) *identityWatch {
	iw := &identityWatch{w: w, e: e}
	for _, f := range []string{e.id.key.caFile, e.id.key.certFile, e.id.key.keyFile} {
		if d := filepath.Dir(f); f != "" && !slices.Contains(iw.dirs, d) {
			iw.dirs = append(iw.dirs, d)
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range iw.dirs {
		wd := w.dirs[d]
		if wd == nil {
			wd = &watchedDir{identities: map[*identityWatch]struct{}{}}
			w.dirs[d] = wd
			if !w.pool.opts.disableNotify {
				w.unwatched++
				w.watchLocked(d, wd)
			}
		}
		wd.identities[iw] = struct{}{}
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
	for _, d := range iw.dirs {
		wd := w.dirs[d]
		if delete(wd.identities, iw); len(wd.identities) > 0 {
			continue
		}
		delete(w.dirs, d)
		switch {
		case wd.watched:
			_ = w.notify.Remove(d) // the kernel drops the watch of a removed directory itself
		case !w.pool.opts.disableNotify:
			w.unwatched--
		}
	}
	w.logRecoveryLocked()
}

// watchLocked asks the kernel to watch d, which has no watch yet. After close
// began it sets none: close closes notify once the run goroutine has exited,
// so a watcher made later would never be closed.
func (w *fileWatcher) watchLocked(d string, wd *watchedDir) {
	if w.closing() {
		return
	}
	if w.notify == nil {
		n, err := fsnotify.NewWatcher()
		if err != nil {
			w.logRefusalLocked(d, fmt.Errorf("no inotify instance: %w", err))
			return
		}
		w.notify = n
		select {
		case w.notifyChanged <- struct{}{}:
		default:
		}
	}
	if err := w.notify.Add(d); err != nil {
		w.logRefusalLocked(d, err)
		return
	}
	wd.watched = true
	w.unwatched--
	w.logRecoveryLocked()
}

func (w *fileWatcher) logRefusalLocked(d string, err error) {
	if w.refusalLogged {
		return
	}
	w.refusalLogged = true
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
	if w.unwatched == 0 && w.refusalLogged {
		w.refusalLogged = false
		w.pool.opts.logger.Info("File events available again for every watched directory")
	}
}

// close stops the watcher and waits for its goroutines. A read stuck in the
// kernel is not waited for (see stuckReads). Every call returns once the
// watcher has stopped, with what closing its fsnotify watcher returned.
func (w *fileWatcher) close() error {
	w.closeOnce.Do(func() {
		close(w.done)
		w.queue.ShutDown()
		w.running.Wait()
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.notify != nil {
			w.closeErr = w.notify.Close()
		}
	})
	return w.closeErr
}

// closing reports whether close has begun.
func (w *fileWatcher) closing() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// run turns file events, polls and fallback polls into reloads.
func (w *fileWatcher) run() {
	defer w.running.Done()
	opts := &w.pool.opts
	var poll <-chan time.Time
	if opts.pollInterval > 0 {
		t := time.NewTicker(opts.pollInterval)
		defer t.Stop()
		poll = t.C
	}
	fallback := time.NewTicker(opts.fallbackPoll)
	defer fallback.Stop()
	var notify *fsnotify.Watcher
	var events <-chan fsnotify.Event
	var errs <-chan error
	for {
		w.mu.Lock()
		if w.notify != notify {
			notify = w.notify
			events, errs = notify.Events, notify.Errors
		}
		w.mu.Unlock()
		select {
		case <-w.done:
			return
		case <-w.notifyChanged:
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			w.onEvent(ev)
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			// Typically a queue overflow: events were lost.
			opts.logger.Info("File watch error; re-reading every watched file", "err", err)
			w.reloadAll(w.all())
		case <-poll:
			w.reloadAll(w.all())
		case <-fallback.C:
			w.reloadAll(w.retryWatches())
		}
	}
}

// onEvent reloads, after the debounce, the identities with a file in the
// event's directory. A watched directory that goes away takes its watch with
// it: it is polled until it is back.
func (w *fileWatcher) onEvent(ev fsnotify.Event) {
	var due []*identityWatch
	w.mu.Lock()
	if wd := w.dirs[filepath.Dir(ev.Name)]; wd != nil {
		due = slices.Collect(maps.Keys(wd.identities))
	}
	if wd := w.dirs[ev.Name]; wd != nil && wd.watched && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		wd.watched = false
		w.unwatched++
		due = append(due, slices.Collect(maps.Keys(wd.identities))...)
	}
	w.mu.Unlock()
	for _, iw := range due {
		// A burst of writes (a pair written file after file) settles into one
		// reload a debounce after its first event.
		if iw.due.CompareAndSwap(false, true) {
			time.AfterFunc(w.pool.opts.debounce, func() {
				iw.due.Store(false)
				w.queue.Add(iw)
			})
		}
	}
}

// retryWatches notes the directories whose watch the kernel dropped without
// an event (an unmount), tries again to watch every directory without its
// watch, and returns the identities with files in those: the fallback poll
// reloads them.
func (w *fileWatcher) retryWatches() []*identityWatch {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.notify != nil && len(w.notify.WatchList()) != len(w.dirs)-w.unwatched {
		list := w.notify.WatchList()
		for d, wd := range w.dirs {
			if wd.watched && !slices.Contains(list, d) {
				wd.watched = false
				w.unwatched++
			}
		}
	}
	var missed []*identityWatch
	for d, wd := range w.dirs {
		if w.unwatched == 0 {
			break
		}
		if !wd.watched {
			w.watchLocked(d, wd)
			missed = append(missed, slices.Collect(maps.Keys(wd.identities))...)
		}
	}
	return missed
}

// work runs reloads until the queue shuts down.
func (w *fileWatcher) work() {
	defer w.running.Done()
	for {
		iw, shutdown := w.queue.Get()
		if shutdown {
			return
		}
		iw.reload()
		w.queue.Done(iw)
	}
}

func (w *fileWatcher) reloadAll(iws []*identityWatch) {
	for _, iw := range iws {
		w.queue.Add(iw)
	}
}

// all returns every identity watched.
func (w *fileWatcher) all() []*identityWatch {
	w.mu.Lock()
	defer w.mu.Unlock()
	all := map[*identityWatch]struct{}{}
	for _, wd := range w.dirs {
		maps.Copy(all, wd.identities)
	}
	return slices.Collect(maps.Keys(all))
}

// unwatchedDirs is the number of directories watched by polling alone.
func (w *fileWatcher) unwatchedDirs() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.unwatched
}
