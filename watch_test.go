package sharedtransport

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

// stallingReloader is a reloader whose reloads wait until release closes,
// as a read of a hung network mount waits.
type stallingReloader struct {
	started  atomic.Int32
	inFlight atomic.Int32
	maxLive  atomic.Int32 // the most reloads seen running at once
	release  chan struct{}
}

func (r *stallingReloader) reload() {
	r.started.Add(1)
	n := r.inFlight.Add(1)
	for m := r.maxLive.Load(); n > m && !r.maxLive.CompareAndSwap(m, n); m = r.maxLive.Load() {
	}
	if r.release != nil {
		<-r.release
	}
	r.inFlight.Add(-1)
}

// TestHungReloadHoldsItsOwnIdentity: reloads that never return, more of them
// than the watcher ever ran at once, hold up their own identities only:
// another identity's files are reloaded on every event meanwhile, a hung
// identity is never reloaded twice at once, and close waits for the reloads
// once they return.
func TestHungReloadHoldsItsOwnIdentity(t *testing.T) {
	w := newFileWatcher(watchSettings{poll: 20 * time.Millisecond, debounce: time.Millisecond, logger: klog.Background()})
	release := make(chan struct{})
	var hung []*stallingReloader
	for i := range 8 {
		dir := filepath.Join(t.TempDir(), "hung", string(rune('a'+i)))
		must(t, os.MkdirAll(dir, 0o755))
		r := &stallingReloader{release: release}
		w.add(r, filepath.Join(dir, "tls.crt"))
		hung = append(hung, r)
	}
	waitFor(t, "every hung identity's reload under way", func() bool {
		for _, r := range hung {
			if r.inFlight.Load() == 0 {
				return false
			}
		}
		return true
	})

	dir := t.TempDir()
	good := &stallingReloader{}
	w.add(good, filepath.Join(dir, "tls.crt"))
	for i := range 3 {
		before := good.started.Load()
		must(t, os.WriteFile(filepath.Join(dir, "tls.crt"), []byte{byte(i)}, 0o600))
		waitFor(t, "the other identity's reload after a write", func() bool { return good.started.Load() > before })
	}

	// Polls went on meanwhile: each hung identity has one more reload due,
	// run once its first returns.
	closed := make(chan struct{})
	go func() {
		close(release)
		w.close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("close did not return after the reloads did")
	}
	for i, r := range hung {
		if n := r.maxLive.Load(); n != 1 {
			t.Errorf("hung identity %d: %d reloads ran at once, want 1", i, n)
		}
		if n := r.inFlight.Load(); n != 0 {
			t.Errorf("hung identity %d: %d reloads still running after close", i, n)
		}
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

// watchList returns the directories fsnotify watches, on every watcher.
func (w *fileWatcher) watchList() []string {
	w.mu.Lock()
	notify := slices.Collect(maps.Values(w.notify))
	w.mu.Unlock()
	var list []string
	for _, n := range notify {
		list = append(list, n.WatchList()...)
	}
	return list
}
