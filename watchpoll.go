// Polling what the kernel will not watch: when it refuses an inotify
// instance or a watch (its per-user limits), or drops a watch (an unmount),
// the directories concerned are polled every options.fallbackPoll, the
// watch is tried again at the same time, and the refusal and the recovery
// are logged once each.

package sharedtransport

import (
	"errors"
	"slices"
	"syscall"
)

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
