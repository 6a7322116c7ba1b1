// Where an identity's files lie: the paths a read of each goes through
// (kubelet's ..data symlinks), looked up again after a change, and the
// directory watches those paths hold, counted per directory.

package sharedtransport

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

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
	for _, f := range []string{id.key.caFile, id.key.certFile, id.key.keyFile} {
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
