// Package klogcapture sends klog's output to a buffer for the length of a
// test, for tests that look for secrets in what is logged.
package klogcapture

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"sync"
	"testing"

	"k8s.io/klog/v2"
)

// Buffer is a bytes.Buffer safe for klog's concurrent writes.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns what was logged so far, klog's buffers flushed.
func (b *Buffer) String() string {
	klog.Flush()
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Start sends klog's output, at verbosity v, to the returned buffer until
// the test ends.
func Start(t testing.TB, v int) *Buffer {
	t.Helper()
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	set := func(name, value string) {
		if err := fs.Set(name, value); err != nil {
			t.Fatal(err)
		}
	}
	buf := &Buffer{}
	set("v", fmt.Sprint(v))
	set("logtostderr", "false")
	set("alsologtostderr", "false")
	set("stderrthreshold", "FATAL")
	klog.SetOutput(buf)
	t.Cleanup(func() {
		klog.Flush()
		set("v", "0")
		set("logtostderr", "true")
		set("stderrthreshold", "ERROR")
		klog.SetOutput(os.Stderr)
	})
	return buf
}
