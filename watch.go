// Watching an identity's files: fsnotify watches the directories of the
// files, one watcher per file system, and events and polls become reloads,
// each identity's on a goroutine of its own.

package sharedtransport

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
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
//
// Nothing here waits on a file system for more than one directory: each
// directory's stat and watch run on a goroutine of its own, and each file
// system has its own fsnotify watcher, whose lock fsnotify holds across the
// kernel's lookup of a directory it adds. A hung mount holds up the
// identities with files there, and no other.
type fileWatcher struct {
	set watchSettings
	// queue holds the identities due a reload, each once; one added while
	// its reload runs follows it, so reloads of one identity never race.
	queue   workqueue.TypedDelayingInterface[*identityWatch]
	done    chan struct{}  // closed by close
	running sync.WaitGroup // the poll, dispatch and event goroutines, and reloads

	mu            sync.Mutex // guards the fields below; never held across a call into fsnotify or a file system
	closed        bool
	notify        map[uint64]*fsnotify.Watcher // by the device of the directories it watches
	dirs          map[string]*watchedDir
	refusalLogged bool // cleared when every directory has its watch again
}

// watchedDir is a directory some identity has a file in. Only its place
// goroutine calls fsnotify for it, so its watch changes one call at a time.
type watchedDir struct {
	identities map[*identityWatch]struct{} // with a file in it
	placing    bool                        // its place goroutine runs
	again      bool                        // asked to place it again while placing
	watch      *fsnotify.Watcher           // holds its watch; nil: none
	on         os.FileInfo                 // the directory the watch is on
}

// identityWatch is one identity's interest in its files.
type identityWatch struct {
	w    *fileWatcher
	r    reloader
	dirs []string // the directories of the identity's files
}

// A reloader is what the watcher reloads: an identity's rotation, which
// re-reads its files.
type reloader interface{ reload() }

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
		set:    set,
		queue:  workqueue.NewTypedDelayingQueueWithConfig(workqueue.TypedDelayingQueueConfig[*identityWatch]{}),
		done:   make(chan struct{}),
		notify: map[uint64]*fsnotify.Watcher{},
		dirs:   map[string]*watchedDir{},
	}
	w.running.Add(2)
	go w.run()
	go w.dispatch()
	return w
}

// add starts watching files ("" for none) for r. It returns before the
// watches are in place; r is reloaded once they are, for what changed
// between its read and then.
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
		}
		wd.identities[iw] = struct{}{}
		if wd.watch == nil || wd.placing {
			w.placeLocked(d, wd)
		}
	}
	return iw
}

// stop stops watching iw's files; the directories no identity needs lose
// their watches.
func (iw *identityWatch) stop() {
	w := iw.w
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range iw.dirs {
		wd := w.dirs[d]
		if delete(wd.identities, iw); len(wd.identities) == 0 {
			w.placeLocked(d, wd)
		}
	}
	w.logRecoveryLocked()
}

// placeLocked starts d's place goroutine, or has the running one go again.
func (w *fileWatcher) placeLocked(d string, wd *watchedDir) {
	switch {
	case w.set.noEvents || w.closed:
		if len(wd.identities) == 0 && !wd.placing {
			delete(w.dirs, d)
		}
	case wd.placing:
		wd.again = true
	default:
		wd.placing = true
		go w.place(d, wd)
	}
}

// place puts d's watch where d is now, on the watcher of its file system,
// or takes it away when no identity needs d. The poll runs it again, so a
// watch the kernel dropped (an unmount) or left on a directory mounted over
// is put back.
func (w *fileWatcher) place(d string, wd *watchedDir) {
	for {
		w.mu.Lock()
		wd.again = false
		want := len(wd.identities) > 0 && !w.closed
		w.mu.Unlock()
		var fi os.FileInfo
		var err error
		if want {
			fi, err = os.Stat(d) // may hang: d's own goroutine waits
		}
		w.move(d, wd, fi, err)
		w.mu.Lock()
		if !wd.again || w.closed {
			wd.placing = false
			if len(wd.identities) == 0 && wd.watch == nil {
				delete(w.dirs, d)
			}
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
	}
}

// move puts d's watch on the directory fi describes (nil: takes it away),
// unless it is there; err is why fi is nil.
func (w *fileWatcher) move(d string, wd *watchedDir, fi os.FileInfo, err error) {
	w.mu.Lock()
	old := wd.watch
	if fi != nil && old != nil && os.SameFile(fi, wd.on) {
		w.mu.Unlock()
		return
	}
	var n *fsnotify.Watcher
	if fi != nil {
		n, err = w.watcherLocked(deviceOf(fi))
	}
	wd.watch, wd.on = n, fi // n stays in use while it adds d
	w.mu.Unlock()
	if old != nil {
		_ = old.Remove(d) // fails when the kernel dropped the watch itself
	}
	tried := n
	if n != nil {
		if err = n.Add(d); err != nil {
			n = nil
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	wd.watch = n
	w.releaseLocked(old)
	w.releaseLocked(tried)
	switch {
	case err != nil && len(wd.identities) > 0:
		w.logRefusalLocked(d, err)
	case n != nil:
		w.logRecoveryLocked()
		for iw := range wd.identities {
			w.queue.Add(iw) // for what changed before the watch was in place
		}
	}
}

// watcherLocked returns the watcher of device dev's directories, starting it
// if there is none.
func (w *fileWatcher) watcherLocked(dev uint64) (*fsnotify.Watcher, error) {
	if w.closed {
		return nil, nil
	}
	if n := w.notify[dev]; n != nil {
		return n, nil
	}
	n, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("no inotify instance: %w", err)
	}
	w.notify[dev] = n
	w.running.Add(1)
	go w.events(n)
	return n, nil
}

// releaseLocked closes n when no directory has its watch there.
func (w *fileWatcher) releaseLocked(n *fsnotify.Watcher) {
	if n == nil || w.closed {
		return // close closes every watcher
	}
	for _, wd := range w.dirs {
		if wd.watch == n {
			return
		}
	}
	for dev, m := range w.notify {
		if m == n {
			delete(w.notify, dev)
			w.running.Add(1)
			go func() {
				defer w.running.Done()
				_ = n.Close()
			}()
		}
	}
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
		if wd.watch == nil && len(wd.identities) > 0 {
			return
		}
	}
	w.refusalLogged = false
	w.set.logger.Info("File events available again for every watched directory")
}

// close stops the watcher and waits for its goroutines, reloads held in a
// read by the kernel too, but not a directory's place goroutine held there.
func (w *fileWatcher) close() error {
	w.mu.Lock()
	w.closed = true
	notify := slices.Collect(maps.Values(w.notify))
	w.notify = nil
	w.mu.Unlock()
	close(w.done)
	w.queue.ShutDown()
	var errs []error
	for _, n := range notify {
		errs = append(errs, n.Close())
	}
	w.running.Wait()
	return errors.Join(errs...)
}

// run re-reads every identity at each poll, and places every directory's
// watch again.
func (w *fileWatcher) run() {
	defer w.running.Done()
	if w.set.poll <= 0 {
		return
	}
	t := time.NewTicker(w.set.poll)
	defer t.Stop()
	for {
		select {
		case <-w.done:
			return
		case <-t.C:
			w.mu.Lock()
			for d, wd := range w.dirs {
				w.placeLocked(d, wd)
			}
			w.mu.Unlock()
			w.reloadAll()
		}
	}
}

// events turns n's events into reloads until n closes.
func (w *fileWatcher) events(n *fsnotify.Watcher) {
	defer w.running.Done()
	for {
		select {
		case ev, ok := <-n.Events:
			if !ok {
				return
			}
			w.onEvent(ev)
		case err, ok := <-n.Errors:
			if !ok {
				return
			}
			// Typically a queue overflow: events were lost.
			w.set.logger.Info("File watch error; re-reading every watched file", "err", err)
			w.reloadAll()
		}
	}
}

// onEvent reloads the identities with a file in the event's directory, a
// debounce after the first event of a burst. A watched directory that goes
// away takes its watch with it: it is placed again at the next poll.
func (w *fileWatcher) onEvent(ev fsnotify.Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if wd := w.dirs[filepath.Dir(ev.Name)]; wd != nil {
		for iw := range wd.identities {
			w.queue.AddAfter(iw, w.set.debounce) // keeps the first of a burst
		}
	}
	if wd := w.dirs[ev.Name]; wd != nil && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		wd.on = nil // a directory by that name is watched again
		for iw := range wd.identities {
			w.queue.AddAfter(iw, w.set.debounce)
		}
	}
}

// dispatch starts the reloads due until the queue shuts down, each on a
// goroutine of its own: the queue hands out an identity only after its
// reload in flight is done, so there is at most one per identity, and a
// read that hangs holds up its own identity only.
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
