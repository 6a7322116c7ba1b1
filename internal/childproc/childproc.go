// Package childproc runs a part of a program (a role) in a child process of
// the same executable and drives it over the child's stdin and stdout, one
// JSON value per line: first the role's spec, answered by a ready reply,
// then commands, each answered by one reply. The child stops what it runs
// and exits when its stdin closes.
//
// cmd/conncount runs each of its modes' clients and servers this way, and
// the library's tests a member API server whose heap must not count as the
// front's: nothing a role leaves behind (heap, goroutines, timers,
// connections) is measured as part of the parent.
package childproc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"time"
)

// A Role is a child process's part. Handle answers one command; ctx ends
// when the parent closes the child's stdin or goes away. Close releases what
// the role holds before the process exits.
type Role interface {
	Handle(ctx context.Context, cmd string) (any, error)
	Close()
}

// A Starter starts a role from the spec the parent sends first and returns
// the ready reply.
type Starter func(spec []byte) (ready any, role Role, err error)

// Main runs this process as a child when the environment variable env names
// one of roles: it serves the role on stdin and stdout and returns the
// process's exit code with isChild true. When env is unset it returns
// isChild false and the caller goes on as the parent.
func Main(env string, roles map[string]Starter) (code int, isChild bool) {
	name := os.Getenv(env)
	if name == "" {
		return 0, false
	}
	start, ok := roles[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "unknown child role %q\n", name)
		return 2, true
	}
	return Serve(start, os.Stdin, os.Stdout), true
}

type command struct {
	Cmd string `json:"cmd"`
}

type reply struct {
	Error string          `json:"error,omitempty"`
	Value json.RawMessage `json:"value,omitempty"`
}

// Serve is the child's side of the protocol: it starts the role from the
// first line of stdin and answers commands until stdin closes. It returns
// the process's exit code.
func Serve(start Starter, stdin io.Reader, stdout io.Writer) int {
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
	answer := func(v any, err error) bool {
		var r reply
		if err != nil {
			r.Error = err.Error()
		} else if r.Value, err = json.Marshal(v); err != nil {
			r = reply{Error: err.Error()}
		}
		return enc.Encode(r) == nil
	}
	spec, ok := <-lines
	if !ok {
		return 1
	}
	ready, role, err := start(spec)
	if err != nil {
		answer(nil, err)
		return 1
	}
	defer role.Close()
	if !answer(ready, nil) {
		return 1
	}
	for line := range lines {
		var c command
		if err := json.Unmarshal(line, &c); err != nil {
			answer(nil, fmt.Errorf("bad command %q: %w", line, err))
			continue
		}
		if !answer(role.Handle(ctx, c.Cmd)) {
			return 1
		}
	}
	return 0
}

// Child is the parent's handle on a child process.
type Child struct {
	role   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	mu     sync.Mutex // serializes exchanges: one command, one reply
}

// StartTimeout bounds a child's start-up (key generation, kubeconfig
// loading) on a busy machine.
const StartTimeout = 60 * time.Second

// Options say how Start runs the child.
type Options struct {
	// Env is the environment variable that names the role in the child
	// (the one its Main is called with).
	Env string
	// Args are the executable's arguments (a test binary's -test.run).
	Args []string
	// Stderr receives the child's stderr; nil discards it.
	Stderr io.Writer
}

// Start starts this executable in role, sends spec and decodes the ready
// reply into ready.
func Start(ctx context.Context, role string, opts Options, spec, ready any) (*Child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, opts.Args...)
	cmd.Env = append(os.Environ(), opts.Env+"="+role)
	cmd.Stderr = opts.Stderr
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
	c := &Child{role: role, cmd: cmd, stdin: stdin, stdout: bufio.NewReader(stdout)}
	sctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	if err := c.exchange(sctx, spec, ready); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("start %s process: %w", role, err)
	}
	return c, nil
}

// Call sends cmd and decodes the reply into out (nil: ignore it).
func (c *Child) Call(ctx context.Context, cmd string, out any) error {
	if err := c.exchange(ctx, command{Cmd: cmd}, out); err != nil {
		return fmt.Errorf("%s process, %s: %w", c.role, cmd, err)
	}
	return nil
}

// exchange writes v as one line and reads one reply. When ctx ends first,
// the child is killed, which ends the read.
func (c *Child) exchange(ctx context.Context, v, out any) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		b, err := json.Marshal(v)
		if err == nil {
			_, err = c.stdin.Write(append(b, '\n'))
		}
		var r reply
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

// Close closes the child's stdin, which ends it, and waits for it to exit;
// a child still running after 30 seconds is killed. The error is the
// child's exit status.
func (c *Child) Close() error {
	_ = c.stdin.Close()
	exited := make(chan error, 1)
	go func() { exited <- c.cmd.Wait() }()
	select {
	case err := <-exited:
		return err
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		return fmt.Errorf("%s process did not exit in 30s: %w", c.role, <-exited)
	}
}
