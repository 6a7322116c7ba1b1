//go:build unix

package sharedtransport

import (
	"os"
	"syscall"
)

// deviceOf returns the device of the file system fi lies on.
func deviceOf(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Dev)
	}
	return 0
}
