// Watching an identity's files: one fsnotify watcher per pool watches the
// directories of the files, and events and polls become reloads, each
// identity's on a goroutine of its own.

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
	"k8s.io/klog/v2"
)

// fileWatcher watches directories, not files: kubelet swaps a secret
// volume's "..data" symlink beside the names a config holds, and
// certificate managers rename new files over old ones; a watch on the file
// sees neither. An event in a directory reloads, a debounce after the
// first, every identity with a file there. A link into another directory
// is seen by the poll.
type fileWatcher struct {
	set watchSettings
	// queue holds the identities due a reload, each once; one added while
	// its reload runs follows it, so reloads of one identity never race,
	// and a read that hangs holds up its own identity's reloads only.
	queue   *workqueue.Typed[*identityWatch]
	done    chan struct{}  // closed by close
	running sync.WaitGroup // the run and dispatch goroutines, and reloads

	mu            sync.Mutex        // guards the fields below
	notify        *fsnotify.Watcher // nil while the kernel refuses an inotify instance, or with disableNotify
	notifyChanged chan struct{}     // the run goroutine takes a new notify's events
	dirs          map[string]*watchedDir
	refusalLogged bool // cleared when every directory has its watch again
}

type watchedDir struct {
	identities map[*identityWatch]struct{} // with a file in it
	watched    bool                        // its inotify watch is in place
}

// identityWatch is one identity's interest in its files.
type identityWatch struct {
	w    *fileWatcher
	r    reloader
	dirs []string    // the directories of the identity's files
	due  atomic.Bool // a debounced reload is on its way to the queue
}

// A reloader is what the watcher reloads: an identity's entry.
type reloader interface {
	// reload re-reads the files.
	reload()
}

// watchSettings are a watcher's settings, from the pool's options.
type watchSettings struct {
	noEvents bool          // poll only; fsnotify is not used
	poll     time.Duration // how often every identity is re-read (0: never); directories without a watch try again
	debounce time.Duration // how long events settle before a reload
	logger   klog.Logger
}

// newFileWatcher starts a watcher and its workers.
func newFileWatcher(set watchSettings) *fileWatcher {
	w := &fileWatcher{
		set:           set,
		queue:         workqueue.NewTyped[*identityWatch](),
		done:          make(chan struct{}),
		notifyChanged: make(chan struct{}, 1),
		dirs:          map[string]*watchedDir{},
	}
	if !set.noEvents {
		// A refusal (fs.inotify.max_user_instances) is logged when the first
		// directory goes without its watch, and retried at each poll.
		w.notify, _ = fsnotify.NewWatcher()
	}
	w.running.Add(2)
	go w.run()
	go w.dispatch()
	return w
}

// add starts watching files ("" for none) for r.
func (w *fileWatcher) add(r reloader, files ...string) *identityWatch {
	iw := &identityWatch{w: w, r: r}
	for _, f := range files {
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
			if !w.set.noEvents {
				w.watchLocked(d, wd)
			}
		}
		wd.identities[iw] = struct{}{}
	}
	return iw
}

// stop stops watching iw's files, and the directories no identity needs.
func (iw *identityWatch) stop() {
	w := iw.w
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range iw.dirs {
		wd := w.dirs[d]
		if delete(wd.identities, iw); len(wd.identities) > 0 {
			continue
		}
		delete(w.dirs, d)
		if wd.watched {
			_ = w.notify.Remove(d) // the kernel drops the watch of a removed directory itself
		}
	}
	w.logRecoveryLocked()
}

// watchLocked asks the kernel to watch d, unless close has begun (a
// watcher made then would never be closed).
func (w *fileWatcher) watchLocked(d string, wd *watchedDir) {
	select {
	case <-w.done:
		return
	default:
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
	w.set.logger.Info("File events unavailable for a watched directory; the poll reads its files and tries its watch again",
		"dir", d, "err", err.Error(), "pollInterval", w.set.poll, "hint", hint)
}

func (w *fileWatcher) logRecoveryLocked() {
	if !w.refusalLogged {
		return
	}
	for _, wd := range w.dirs {
		if !wd.watched {
			return
		}
	}
	w.refusalLogged = false
	w.set.logger.Info("File events available again for every watched directory")
}

// close stops the watcher and waits for its goroutines: a reload in a read
// the kernel holds holds close too.
func (w *fileWatcher) close() error {
	close(w.done)
	w.queue.ShutDown()
	w.running.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.notify != nil {
		return w.notify.Close()
	}
	return nil
}

// run turns file events and polls into reloads.
func (w *fileWatcher) run() {
	defer w.running.Done()
	var poll <-chan time.Time
	if w.set.poll > 0 {
		t := time.NewTicker(w.set.poll)
		defer t.Stop()
		poll = t.C
	}
	var notify *fsnotify.Watcher
	var events <-chan fsnotify.Event
	var errs <-chan error
	for {
		w.mu.Lock()
		if w.notify != notify {
			notify, events, errs = w.notify, nil, nil
			if notify != nil {
				events, errs = notify.Events, notify.Errors
			}
		}
		w.mu.Unlock()
		select {
		case <-w.done:
			return
		case <-w.notifyChanged:
		case ev, ok := <-events:
			if !ok {
				events, errs = nil, nil // fsnotify stopped: the poll reads
				continue
			}
			w.onEvent(ev)
		case err, ok := <-errs:
			if !ok {
				events, errs = nil, nil
				continue
			}
			// Typically a queue overflow: events were lost.
			w.set.logger.Info("File watch error; re-reading every watched file", "err", err)
			w.reloadAll()
		case <-poll:
			w.retryWatches()
			w.reloadAll()
		}
	}
}

// onEvent reloads the identities with a file in the event's directory, a
// debounce after the first event of a burst. A watched directory that goes
// away takes its watch with it: it is polled until it is back.
func (w *fileWatcher) onEvent(ev fsnotify.Event) {
	var due []*identityWatch
	w.mu.Lock()
	if wd := w.dirs[filepath.Dir(ev.Name)]; wd != nil {
		due = slices.Collect(maps.Keys(wd.identities))
	}
	if wd := w.dirs[ev.Name]; wd != nil && wd.watched && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		wd.watched = false
		due = slices.AppendSeq(due, maps.Keys(wd.identities))
	}
	w.mu.Unlock()
	for _, iw := range due {
		if !iw.due.Swap(true) {
			time.AfterFunc(w.set.debounce, func() {
				iw.due.Store(false)
				w.queue.Add(iw)
			})
		}
	}
}

// retryWatches notes the directories whose watch the kernel dropped
// silently (an unmount) and tries again to watch every directory without
// one; the poll reads their files meanwhile.
func (w *fileWatcher) retryWatches() {
	if w.set.noEvents {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var list []string
	if w.notify != nil {
		list = w.notify.WatchList()
	}
	for d, wd := range w.dirs {
		if wd.watched && !slices.Contains(list, d) {
			wd.watched = false
		}
		if !wd.watched {
			w.watchLocked(d, wd)
		}
	}
}

// dispatch starts the reloads due until the queue shuts down, each on a
// goroutine of its own: the queue hands out an identity only after its
// reload in flight is done, so there is at most one per identity.
func (w *fileWatcher) dispatch() {
	defer w.running.Done()
	for {
		iw, shutdown := w.queue.Get()
		if shutdown {
			return
		}
		w.running.Add(1)
		go func() {
			defer w.running.Done()
			iw.r.reload()
			w.queue.Done(iw)
		}()
	}
}

// reloadAll queues a reload of every identity watched.
func (w *fileWatcher) reloadAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, wd := range w.dirs {
		for iw := range wd.identities {
			w.queue.Add(iw) // once, however many directories it has
		}
	}
}
