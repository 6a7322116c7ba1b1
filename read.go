// Reading certificate files: bounded in size, refused when they are not
// regular files, and bounded in time, so a hung file system never holds a
// caller.

package sharedtransport

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
	"syscall"
	"time"
)

// maxMaterialFile bounds what is read of a certificate, key or CA file: a
// bundle of every public root CA is about 250 KB.
const maxMaterialFile = 4 << 20

// dataOrFile returns inline data, or the content of file when there is none:
// client-go's rule for material it does not reload.
func (r *fileReads) dataOrFile(data []byte, file, what string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	var b []byte
	err := r.read(nil, []fileToRead{{file, what, &b}})
	return b, err
}

// readFile reads a regular file of at most maxMaterialFile bytes; anything
// else is refused unread (O_NONBLOCK: opening a named pipe does not wait).
func readFile(path, what string) ([]byte, error) {
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
	}
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

// fileReads reads one pool's certificate files, each read bounded in time.
// A read that does not return (a hung network mount) cannot be cancelled:
// it is left to finish on its goroutine while its caller moves on, and its
// file is refused until it has, so a hung file holds one goroutine however
// often it is asked for.
type fileReads struct {
	timeout time.Duration // how long a read may take

	mu    sync.Mutex           // guards stuck
	stuck map[string]time.Time // files whose read outlived its wait, and since when
}

// fileToRead is one file of a read, and where its content goes.
type fileToRead struct {
	path, what string
	into       *[]byte
}

// errStopped is what a read returns when its done channel closed first.
var errStopped = errors.New("sharedtransport: the read was stopped: the pool is closing")

// read reads files in order until they are read, the timeout has passed, or
// done is closed (errStopped).
func (s *fileReads) read(done <-chan struct{}, files []fileToRead) error {
	deadline := time.NewTimer(s.timeout)
	defer deadline.Stop()
	for _, f := range files {
		s.mu.Lock()
		since, stuck := s.stuck[f.path]
		s.mu.Unlock()
		if stuck {
			return fmt.Errorf("sharedtransport: read %s file %q: an earlier read has not returned for %v (a hung network file system?)",
				f.what, f.path, time.Since(since).Round(time.Second))
		}
		var b []byte
		got := make(chan error, 1)
		go func() {
			var err error
			b, err = readFile(f.path, f.what)
			got <- err
			s.mark(f.path, false)
		}()
		var err error
		select {
		case err = <-got:
			if err != nil {
				return err
			}
			*f.into = b
			continue
		case <-done:
			err = errStopped
		case <-deadline.C:
			err = fmt.Errorf("sharedtransport: read %s file %q: no answer after %v (a hung network file system?)", f.what, f.path, s.timeout)
		}
		s.mark(f.path, true)
		select {
		case <-got: // it returned after all
			s.mark(f.path, false)
		default:
		}
		return err
	}
	return nil
}

func (s *fileReads) mark(path string, stuck bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch _, ok := s.stuck[path]; {
	case stuck && !ok:
		if s.stuck == nil {
			s.stuck = map[string]time.Time{}
		}
		s.stuck[path] = time.Now()
	case !stuck:
		delete(s.stuck, path)
	}
}
