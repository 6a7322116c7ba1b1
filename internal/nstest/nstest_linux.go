// Package nstest runs a test again in a child process of the test binary
// inside new Linux namespaces of its own: a network namespace whose loopback
// only the test uses, a user namespace whose per-user kernel limits the test
// may lower and exhaust without starving the machine's other processes.
package nstest

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Namespaces says where a test runs again.
type Namespaces struct {
	// Env is the environment variable that tells the child which test it
	// runs.
	Env string
	// Cloneflags are the namespaces to make besides the user namespace
	// (CLONE_NEWUSER, which maps the test's user to root in it): say
	// syscall.CLONE_NEWNET.
	Cloneflags uintptr
	// Where names the namespaces in the parent's report.
	Where string
	// Timeout bounds the child's run (its -test.timeout).
	Timeout time.Duration
	// Setup, if set, runs in the child before the test goes on.
	Setup func() error
}

// Rerun runs the calling test again, alone, in a child process in new
// namespaces as ns says. It returns true in the child, where the test goes
// on, and false in the parent, which waits for the child, logs the child's
// test output and fails t if the child failed.
func Rerun(t *testing.T, ns Namespaces) bool {
	t.Helper()
	if os.Getenv(ns.Env) == t.Name() {
		if ns.Setup != nil {
			if err := ns.Setup(); err != nil {
				t.Fatalf("set up %s: %v", ns.Where, err)
			}
		}
		return true
	}
	var run []string
	for _, part := range strings.Split(t.Name(), "/") {
		run = append(run, "^"+regexp.QuoteMeta(part)+"$")
	}
	cmd := exec.Command(os.Args[0], "-test.run="+strings.Join(run, "/"), "-test.v", "-test.count=1", fmt.Sprintf("-test.timeout=%v", ns.Timeout))
	cmd.Env = append(os.Environ(), ns.Env+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | ns.Cloneflags,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	out, err := cmd.CombinedOutput()
	var lines []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "_test.go:") || strings.HasPrefix(strings.TrimSpace(l), "---") || strings.Contains(l, "panic") {
			lines = append(lines, l)
		}
	}
	t.Logf("in %s:\n%s", ns.Where, strings.Join(lines, "\n"))
	if err != nil {
		t.Fatalf("the test failed in %s (or none could be made: this test needs unprivileged user namespaces): %v", ns.Where, err)
	}
	return false
}
