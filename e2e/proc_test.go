package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// Child processes (etcd, kube-apiserver) run in process groups of their own
// and get SIGKILL from the kernel when the thread that started them dies
// (Pdeathsig). All of them are started from one goroutine locked to its OS
// thread for the life of the test binary, so that thread dies only with the
// process: a panic, a test timeout or os.Exit cannot leave a server behind.

type startRequest struct {
	cmd  *exec.Cmd
	done chan error
}

var (
	starter   = make(chan startRequest)
	startOnce sync.Once

	liveMu sync.Mutex
	live   = map[*proc]struct{}{}
)

func startLoop() {
	runtime.LockOSThread() // never unlocked: this thread lives as long as the process
	for r := range starter {
		r.done <- r.cmd.Start()
	}
}

// proc is a running child process.
type proc struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // set when exited is closed
	log    string
}

func startProc(name, logPath string, bin string, args ...string) (*proc, error) {
	startOnce.Do(func() {
		go startLoop()
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
		go func() {
			s := <-sig
			killAll()
			fmt.Fprintf(os.Stderr, "e2e: %v: stopped child processes\n", s)
			os.Exit(2)
		}()
	})
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	req := startRequest{cmd: cmd, done: make(chan error)}
	starter <- req
	if err := <-req.done; err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, exited: make(chan struct{}), log: logPath}
	liveMu.Lock()
	live[p] = struct{}{}
	liveMu.Unlock()
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		liveMu.Lock()
		delete(live, p)
		liveMu.Unlock()
		close(p.exited)
	}()
	return p, nil
}

func (p *proc) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL to the process group and waits for the exit.
func (p *proc) kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.exited
}

// stop asks the process group to terminate and kills it after grace.
func (p *proc) stop(grace time.Duration) {
	if !p.running() {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(grace):
		p.kill()
	}
}

func killAll() {
	liveMu.Lock()
	ps := make([]*proc, 0, len(live))
	for p := range live {
		ps = append(ps, p)
	}
	liveMu.Unlock()
	for _, p := range ps {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
}
