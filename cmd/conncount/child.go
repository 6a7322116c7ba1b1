package main

// Every run of a mode happens in processes of its own: this executable
// again, started with envChild naming its role (a mode's client, the
// embedded server, the proxy's members, front or load). Nothing a mode
// leaves behind (heap, goroutines, timers, connections) can then be
// measured as part of the next one. The parent drives a child over its
// stdin and stdout, one JSON value per line: first the role's spec, answered
// by a ready reply, then commands, each answered by one reply. The child
// stops what it runs and exits when its stdin closes.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime/metrics"
	"sync"
	"syscall"
	"time"
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

// childMain runs this process as a child when envChild is set; main and
// TestMain call it first.
func childMain() (code int, isChild bool) {
	name := os.Getenv(envChild)
	if name == "" {
		return 0, false
	}
	start, ok := childRoles[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "conncount: unknown child role %q\n", name)
		return 2, true
	}
	return serveChild(start, os.Stdin, os.Stdout), true
}

type childCommand struct {
	Cmd string `json:"cmd"`
}

type childReply struct {
	Error string          `json:"error,omitempty"`
	Value json.RawMessage `json:"value,omitempty"`
}

// serveChild is the child's side of the protocol.
func serveChild(start roleStarter, stdin io.Reader, stdout io.Writer) int {
	lines := make(chan []byte)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		defer cancel() // stdin closed: the parent is done or gone
		defer close(lines)
		r := bufio.NewReader(stdin)
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			select {
			case lines <- line:
			case <-ctx.Done():
				return
			}
		}
	}()
	enc := json.NewEncoder(stdout)
	reply := func(v any, err error) bool {
		var r childReply
		if err != nil {
			r.Error = err.Error()
		} else if r.Value, err = json.Marshal(v); err != nil {
			r = childReply{Error: err.Error()}
		}
		return enc.Encode(r) == nil
	}
	spec, ok := <-lines
	if !ok {
		return 1
	}
	ready, role, err := start(spec)
	if err != nil {
		reply(nil, err)
		return 1
	}
	defer role.close()
	if !reply(ready, nil) {
		return 1
	}
	for line := range lines {
		var c childCommand
		if err := json.Unmarshal(line, &c); err != nil {
			reply(nil, fmt.Errorf("bad command %q: %w", line, err))
			continue
		}
		if !reply(role.handle(ctx, c.Cmd)) {
			return 1
		}
	}
	return 0
}

// child is the parent's handle on a child process.
type child struct {
	role   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	mu     sync.Mutex // serializes exchanges: one command, one reply
}

// childStartTimeout bounds a child's start-up (key generation, kubeconfig
// loading) on a busy machine.
const childStartTimeout = 60 * time.Second

// startChild starts this executable in role, sends spec and decodes the
// ready reply into ready. The child's stderr (progress, client-go's
// warnings) goes to stderr.
func startChild(ctx context.Context, role string, spec, ready any, stderr io.Writer) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), envChild+"="+role)
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s process: %w", role, err)
	}
	c := &child{role: role, cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
	sctx, cancel := context.WithTimeout(ctx, childStartTimeout)
	defer cancel()
	if err := c.exchange(sctx, spec, ready); err != nil {
		c.close()
		return nil, fmt.Errorf("start %s process: %w", role, err)
	}
	return c, nil
}

// call sends cmd and decodes the reply into out (nil: ignore it).
func (c *child) call(ctx context.Context, cmd string, out any) error {
	if err := c.exchange(ctx, childCommand{Cmd: cmd}, out); err != nil {
		return fmt.Errorf("%s process, %s: %w", c.role, cmd, err)
	}
	return nil
}

// exchange writes v as one line and reads one reply. When ctx ends first,
// the child is killed, which ends the read.
func (c *child) exchange(ctx context.Context, v, out any) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		b, err := json.Marshal(v)
		if err == nil {
			_, err = c.stdin.Write(append(b, '\n'))
		}
		var r childReply
		if err == nil {
			var line []byte
			if line, err = c.stdout.ReadBytes('\n'); err == nil {
				err = json.Unmarshal(line, &r)
			} else if errors.Is(err, io.EOF) {
				err = errors.New("exited without a reply (see its messages above)")
			}
		}
		switch {
		case err != nil:
		case r.Error != "":
			err = errors.New(r.Error)
		case out != nil:
			err = json.Unmarshal(r.Value, out)
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		_ = c.cmd.Process.Kill()
		<-done
		return ctx.Err()
	}
}

// close closes the child's stdin, which ends it, and waits for it to exit.
func (c *child) close() {
	_ = c.stdin.Close()
	exited := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(exited) }()
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-exited
	}
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
