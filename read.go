// Reading certificate files: bounded in size, and refused unread when they
// are not regular files, so a pipe or a device never holds a caller.

package sharedtransport

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"syscall"
)

// maxMaterialFile bounds what is read of a certificate, key or CA file: a
// bundle of every public root CA is about 250 KB.
const maxMaterialFile = 4 << 20

// dataOrFile returns inline data, or the content of file when there is none:
// client-go's rule for material it does not reload.
func dataOrFile(data []byte, file, what string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	return readFile(file, what)
}

// readFile reads a regular file of at most maxMaterialFile bytes; anything
// else is refused unread (O_NONBLOCK: opening a named pipe does not wait). A
// read the kernel holds (a hung network mount) holds its caller, as it holds
// client-go's own read.
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
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("sharedtransport: %s file %q is not a regular file (mode %v): point the config at the file itself", what, path, fi.Mode())
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
