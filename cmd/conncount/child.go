package main

// Every run of a mode happens in processes of its own: this executable
// again, started with envChild naming its role (a mode's client, the
// embedded server, the proxy's members, front or load). Nothing a mode
// leaves behind (heap, goroutines, timers, connections) can then be
// measured as part of the next one. The parent drives a child over its
// stdin and stdout with internal/childproc's protocol: the role's spec,
// answered by a ready reply, then commands, each answered by one reply. The
// child stops what it runs and exits when its stdin closes.

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime/metrics"
	"sync"
	"syscall"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/childproc"
)

// envChild names the role this executable runs in when it is a child of
// conncount; the parent leaves it unset.
const envChild = "CONNCOUNT_CHILD"

// A childRole is a child process's part. handle answers one command; ctx
// ends when the parent closes the child's stdin or goes away. close releases
// what the role holds before the process exits.
type childRole interface {
	handle(ctx context.Context, cmd string) (any, error)
	close()
}

// A roleStarter starts a role from the spec the parent sends first and
// returns the ready reply.
type roleStarter func(spec []byte) (ready any, role childRole, err error)

var childRoles = map[string]roleStarter{
	"server":     startServerRole,
	"members":    startMembersRole,
	"client":     startClientRole,
	"front":      startFrontRole,
	"proxy-load": startProxyLoadRole,
}

// role is a childRole as childproc serves it.
type role struct{ childRole }

func (r role) Handle(ctx context.Context, cmd string) (any, error) { return r.handle(ctx, cmd) }
func (r role) Close()                                              { r.close() }

// childMain runs this process as a child when envChild is set; main and
// TestMain call it first.
func childMain() (code int, isChild bool) {
	roles := make(map[string]childproc.Starter, len(childRoles))
	for name, start := range childRoles {
		roles[name] = func(spec []byte) (any, childproc.Role, error) {
			ready, r, err := start(spec)
			if err != nil {
				return nil, nil, err
			}
			return ready, role{r}, nil
		}
	}
	return childproc.Main(envChild, roles)
}

// child is the parent's handle on a child process.
type child = childproc.Child

// startChild starts this executable in role, sends spec and decodes the
// ready reply into ready. The child's stderr (progress, client-go's
// warnings) goes to stderr.
func startChild(ctx context.Context, role string, spec, ready any, stderr io.Writer) (*child, error) {
	return childproc.Start(ctx, role, childproc.Options{Env: envChild, Stderr: stderr}, spec, ready)
}

// lockedWriter lets several children's stderr share a writer that is not a
// file: exec copies each child's stderr on a goroutine of its own.
type lockedWriter struct {
	mu sync.Mutex // serializes Write
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// childStderr is what the children of one command write their stderr to: a
// file is handed to them as it is, anything else behind a lock.
func childStderr(w io.Writer) io.Writer {
	if _, ok := w.(*os.File); ok {
		return w
	}
	return &lockedWriter{w: w}
}

// usage is what the kernel accounts to this process: CPU time since start
// and the largest resident set it had.
type usage struct {
	CPU       time.Duration
	MaxRSSKiB int64
}

func selfUsage() usage {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return usage{}
	}
	return usage{CPU: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), MaxRSSKiB: ru.Maxrss}
}

// heapSampler keeps the largest Go heap (objects live or not yet swept)
// seen while it runs. A sample is a runtime/metrics read, which does not
// stop the world as runtime.ReadMemStats does.
type heapSampler struct {
	stop chan struct{}
	peak chan uint64
}

const heapMetric = "/memory/classes/heap/objects:bytes"

func startHeapSampler(every time.Duration) *heapSampler {
	h := &heapSampler{stop: make(chan struct{}), peak: make(chan uint64, 1)}
	go func() {
		s := []metrics.Sample{{Name: heapMetric}}
		var peak uint64
		read := func() {
			metrics.Read(s)
			if s[0].Value.Kind() == metrics.KindUint64 {
				peak = max(peak, s[0].Value.Uint64())
			}
		}
		read()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				read()
			case <-h.stop:
				read()
				h.peak <- peak
				return
			}
		}
	}()
	return h
}

// Stop ends sampling and returns the peak in bytes.
func (h *heapSampler) Stop() uint64 {
	close(h.stop)
	return <-h.peak
}

// progressLine shows a load's progress on stderr: redrawn in place on a
// terminal, one line a second otherwise.
type progressLine struct {
	w     io.Writer
	tty   bool
	every time.Duration
	last  time.Time
}

func newProgressLine(w io.Writer) *progressLine {
	p := &progressLine{w: w, tty: isTerminal(w), every: time.Second}
	if p.tty {
		p.every = 200 * time.Millisecond
	}
	return p
}

func (p *progressLine) show(line string, final bool) {
	if p == nil || p.w == nil {
		return
	}
	if !final && time.Since(p.last) < p.every {
		return
	}
	p.last = time.Now()
	switch {
	case p.tty && final:
		fmt.Fprintf(p.w, "\r%s\033[K\n", line)
	case p.tty:
		fmt.Fprintf(p.w, "\r%s\033[K", line)
	default:
		fmt.Fprintln(p.w, line)
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
