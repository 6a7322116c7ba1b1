//go:build !unix

package sharedtransport

import "os"

// deviceOf returns 0: one watcher serves every directory here.
func deviceOf(os.FileInfo) uint64 { return 0 }
