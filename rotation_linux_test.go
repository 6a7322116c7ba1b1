//go:build linux

package sharedtransport

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/nstest"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// unreadable is a way a certificate file can be something a read must not
// wait on: make turns the file at path into it.
type unreadable struct {
	name string
	make func(t testing.TB, path string)
	want string // in the error
}

var unreadables = []unreadable{
	{"named pipe", func(t testing.TB, path string) {
		replaceWith(t, path, func(tmp string) error { return syscall.Mkfifo(tmp, 0o600) })
		// A reader that opens the pipe waits for a writer: let it go when
		// the test ends, whatever happened.
		t.Cleanup(func() {
			if fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
				syscall.Close(fd)
			}
		})
	}, "is not a regular file (mode p"},
	{"symlink to /dev/zero", func(t testing.TB, path string) {
		replaceWith(t, path, func(tmp string) error { return os.Symlink("/dev/zero", tmp) })
	}, "is not a regular file (mode Dc"},
}

// replaceWith renames what create makes over path.
func replaceWith(t testing.TB, path string, create func(tmp string) error) {
	t.Helper()
	tmp := path + ".new"
	must(t, create(tmp))
	must(t, os.Rename(tmp, path))
}

// TestRotationUnreadableFiles: a certificate file that is a named pipe or a
// symlink to /dev/zero is refused unread at Wrap, naming the file; after good
// material it is a rejected reload, the last good material serving on.
func TestRotationUnreadableFiles(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := New(WithPollInterval(100*time.Millisecond), withDebounce(10*time.Millisecond))
	t.Cleanup(func() { p.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for i, u := range unreadables {
		t.Run("at Wrap/"+u.name, func(t *testing.T) {
			c := writeCredFiles(t, filepath.Join(f.dir, "wrap", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
			u.make(t, c.cert)
			// The second attempt names the key inline: a half-file pair is
			// read once, as client-go reads it.
			for attempt := range 2 {
				cfg := c.config(f.srv.URL())
				if attempt == 1 {
					cfg.KeyFile, cfg.KeyData = "", f.alice.KeyPEM
				}
				err := p.Wrap(cfg)
				if err == nil {
					t.Fatal("Wrap succeeded")
				}
				t.Logf("attempt %d: %v", attempt+1, err)
				for _, want := range []string{c.cert, u.want} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error does not say %q", want)
					}
				}
			}
		})
	}

	t.Run("after good material", func(t *testing.T) {
		var clients []*kubernetes.Clientset
		var certs []string
		for i := range unreadables {
			c := writeCredFiles(t, filepath.Join(f.dir, "after", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
			cfg := c.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			cs, err := kubernetes.NewForConfig(cfg)
			must(t, err)
			clients, certs = append(clients, cs), append(certs, c.cert)
		}
		before := p.Stats()
		for i, u := range unreadables {
			u.make(t, certs[i])
		}
		waitFor(t, "every bad file rejected", func() bool {
			return p.Stats().RotationErrors >= before.RotationErrors+uint64(len(unreadables))
		})
		// The last good material is kept: new connections still work.
		f.srv.CloseClientConnections()
		since := time.Now()
		for i, cs := range clients {
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Errorf("%s: a client built before: %v", unreadables[i].name, err)
			}
		}
		if _, ok := rec.firstSince("alice", since); !ok {
			t.Error("the server did not see the last good certificate")
		}
	})
}

// inUserNamespace runs the calling test again, alone, in a child process in
// a new user namespace where the given per-user limits (/proc/sys/user/NAME)
// are set. The kernel's inotify limits are per user and shared by every
// process of that user on the machine; lowered in a namespace of the test's
// own, they can be exhausted without starving anyone else (the namespace's
// use still counts against the machine's limit, up to the namespace's). It
// returns true in the child, where the test goes on, and false in the parent,
// which waits for the child and reports its result.
func inUserNamespace(t *testing.T, limits map[string]int) bool {
	t.Helper()
	return nstest.Rerun(t, nstest.Namespaces{
		Env:     "SHAREDTRANSPORT_TEST_USERNS",
		Where:   fmt.Sprintf("a user namespace with %v", limits),
		Timeout: 3 * time.Minute,
		Setup: func() error {
			for name, v := range limits {
				if err := os.WriteFile("/proc/sys/user/"+name, []byte(strconv.Itoa(v)), 0o644); err != nil {
					return err
				}
			}
			return nil
		},
	})
}

// inotifyWatches returns the watches the kernel holds for each inotify
// instance of this process, by descriptor, from /proc/self/fdinfo.
func inotifyWatches(t testing.TB) map[int]int {
	t.Helper()
	out := map[int]int{}
	for _, fd := range openFDs(t) {
		name := strconv.Itoa(fd)
		if target, err := os.Readlink("/proc/self/fd/" + name); err != nil || target != "anon_inode:inotify" {
			continue
		}
		info, err := os.ReadFile("/proc/self/fdinfo/" + name)
		if err != nil {
			continue // closed meanwhile
		}
		out[fd] = strings.Count(string(info), "inotify wd:")
	}
	return out
}

const (
	refusedLog   = "File events unavailable for a watched directory"
	recoveredLog = "File events available again"
)

// TestInotifyLimits: when the kernel refuses the pool an inotify instance
// (the test holds every one the user may have) or a watch (the user's watch
// limit is reached), Wrap works, rotations are taken by the poll, and the
// refusal is logged once; when the kernel allows them again the poll sets
// the watches, and the pool takes file events again.
//
// Each subtest runs in a user namespace of its own (see inUserNamespace):
// the test needs the kernel to allow one (root does) and a writable
// /proc/sys/user in it, and fails saying so without them.
func TestInotifyLimits(t *testing.T) {
	const poll = 200 * time.Millisecond

	t.Run("instances", func(t *testing.T) { inotifyInstancesExhausted(t, poll) })
	t.Run("watches", func(t *testing.T) { inotifyWatchesExhausted(t, poll) })
}

// unwatchedDirs counts the directories p's watcher holds no watch on, once
// no directory's watch is being placed.
func unwatchedDirs(t *testing.T, p *Pool) int {
	w := p.reg.watcher
	n := 0
	waitFor(t, "every directory's watch placed", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		n = 0
		for _, wd := range w.dirs {
			if wd.placing {
				return false
			}
			if wd.watch == nil {
				n++
			}
		}
		return true
	})
	return n
}

// inotifyInstancesExhausted is TestInotifyLimits's "instances" case.
func inotifyInstancesExhausted(t *testing.T, poll time.Duration) {
	if !inUserNamespace(t, map[string]int{"max_inotify_instances": 8}) {
		return
	}
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	var held []int
	defer func() {
		for _, fd := range held {
			syscall.Close(fd)
		}
	}()
	for range 1000 { // bounded: the limit set above is 8
		fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC)
		if err != nil {
			t.Logf("the kernel refused inotify instance %d: %v", len(held)+1, err)
			break
		}
		held = append(held, fd)
	}
	logs := &logLines{}
	p := newPool(t, WithPollInterval(poll), WithLogger(logs.logger()))
	c := writeCredFiles(t, filepath.Join(f.dir, "files"), f.ca.CertPEM(), f.alice)
	cfg := c.config(f.srv.URL())
	if err := p.Wrap(cfg); err != nil {
		t.Fatalf("Wrap with inotify instances exhausted: %v", err)
	}
	if n := unwatchedDirs(t, p); n != 1 {
		t.Errorf("%d directories without a watch, want 1", n)
	}
	// No file events: the rotation is the poll's.
	rotate(t, p, rec, cfg, c, f.bob)
	time.Sleep(3 * poll) // more failed retries
	if n := logs.count(refusedLog); n != 1 {
		t.Errorf("the refusal was logged %d times, want once", n)
	}

	// Instances free again: the pool takes file events.
	for _, fd := range held {
		syscall.Close(fd)
	}
	held = nil
	waitFor(t, "the directory watched again", func() bool { return unwatchedDirs(t, p) == 0 })
	time.Sleep(poll) // the poll's reload ends
	if got := inotifyWatches(t); len(got) != 1 || sumValues(got) != 1 {
		t.Errorf("the kernel holds watches %v, want one instance with 1 watch", got)
	}
	rotate(t, p, rec, cfg, c, f.carol)
	if n := logs.count(recoveredLog); n != 1 {
		t.Errorf("the recovery was logged %d times, want once", n)
	}
}

// inotifyWatchesExhausted is TestInotifyLimits's "watches" case.
func inotifyWatchesExhausted(t *testing.T, poll time.Duration) {
	const limit = 2
	if !inUserNamespace(t, map[string]int{"max_inotify_watches": limit}) {
		return
	}
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	logs := &logLines{}
	p := newPool(t, WithPollInterval(poll), WithIdleTimeout(0), WithLogger(logs.logger()))
	// Four identities in four directories: two watches, two refused.
	var cfgs [4]*rest.Config
	var files [4]*certDir
	for i := range cfgs {
		files[i] = writeCredFiles(t, filepath.Join(f.dir, strconv.Itoa(i)), f.ca.CertPEM(), f.alice)
		cfgs[i] = files[i].config(f.srv.URL())
		if err := p.Wrap(cfgs[i]); err != nil {
			t.Fatalf("Wrap %d with the watch limit reached: %v", i, err)
		}
	}
	if n := unwatchedDirs(t, p); n != 2 {
		t.Errorf("%d directories without a watch, want 2", n)
	}
	rotate(t, p, rec, cfgs[2], files[2], f.bob) // by the poll
	time.Sleep(3 * poll)
	if n := logs.count(refusedLog); n != 1 {
		t.Errorf("the refusal was logged %d times, want once", n)
	}

	// The two watched identities are released; their watches go, and
	// the other two directories get theirs.
	cfgs[0], cfgs[1] = nil, nil
	waitFor(t, "two identities released", func() bool {
		runtime.GC()
		return p.Stats().Identities == 2
	})
	waitFor(t, "every directory watched", func() bool { return unwatchedDirs(t, p) == 0 })
	time.Sleep(poll)
	if got := inotifyWatches(t); len(got) != 1 || sumValues(got) != limit {
		t.Errorf("the kernel holds watches %v, want one instance with %d", got, limit)
	}
	rotate(t, p, rec, cfgs[3], files[3], f.carol)
	if n := logs.count(recoveredLog); n != 1 {
		t.Errorf("the recovery was logged %d times, want once", n)
	}
}

// rotate writes kp into c (key first, then certificate, each renamed over),
// waits for the pool to take it, and checks on a new connection that the
// server sees it through cfg.
func rotate(t *testing.T, p *Pool, rec *cnRecorder, cfg *rest.Config, c *certDir, kp *testserver.KeyPair) {
	t.Helper()
	before := p.Stats().Rotations
	writeAtomic(t, c.key, kp.KeyPEM)
	writeAtomic(t, c.cert, kp.CertPEM)
	waitFor(t, "rotation to "+kp.Cert.Subject.CommonName, func() bool { return p.Stats().Rotations > before })
	since := time.Now()
	must(t, listNodes(context.Background(), cfg))
	if _, ok := rec.firstSince(kp.Cert.Subject.CommonName, since); !ok {
		t.Errorf("the server did not see %s", kp.Cert.Subject.CommonName)
	}
}

func sumValues(m map[int]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestWatchesFollowIdentities: identities whose files lie in directories of
// their own are created and released, round after round, while the poll
// runs every few milliseconds. Once every identity is released, no watch is
// left: not in the pool's bookkeeping, not in fsnotify's, not in the
// kernel's (/proc/self/fdinfo).
func TestWatchesFollowIdentities(t *testing.T) {
	const rounds, perRound = 3, 40
	f := newFixture(t, testserver.Options{})
	p := newPool(t, WithIdleTimeout(0), WithPollInterval(5*time.Millisecond))
	before := inotifyWatches(t)
	// kernel counts the watches in the inotify instances opened since before.
	kernel := func() int {
		n := 0
		for fd, watches := range inotifyWatches(t) {
			if _, ok := before[fd]; !ok {
				n += watches
			}
		}
		return n
	}
	for round := range rounds {
		var cfgs []*rest.Config
		for i := range perRound {
			c := writeCredFiles(t, filepath.Join(f.dir, fmt.Sprintf("%d-%d", round, i)), f.ca.CertPEM(), f.alice)
			cfg := c.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			cfgs = append(cfgs, cfg)
		}
		waitFor(t, fmt.Sprintf("round %d: a kernel watch for each of %d identities in as many directories", round, perRound),
			func() bool { return kernel() == perRound })
		time.Sleep(50 * time.Millisecond) // polls run over the identities
		if n := kernel(); n != perRound {
			t.Errorf("round %d: the kernel holds %d watches for %d identities in as many directories", round, n, perRound)
		}
		runtime.KeepAlive(cfgs)
		cfgs = nil
		waitReleased(t, p)
	}
	w := p.reg.watcher
	left := func() (inKernel, inFsnotify, inPool int) {
		list := w.watchList()
		w.mu.Lock()
		defer w.mu.Unlock()
		return kernel(), len(list), len(w.dirs)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		kernel, fsnotify, pool := left()
		if kernel == 0 && fsnotify == 0 && pool == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d identities released: %d watches left in the kernel, %d in fsnotify, %d directories in the pool", rounds*perRound, kernel, fsnotify, pool)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
