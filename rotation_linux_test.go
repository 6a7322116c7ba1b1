//go:build linux

package sharedtransport

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/hangfs"
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

func unreadables(hung *hangfs.FS) []unreadable {
	replace := func(t testing.TB, path string, create func(tmp string) error) {
		t.Helper()
		tmp := path + ".new"
		must(t, create(tmp))
		must(t, os.Rename(tmp, path))
	}
	return []unreadable{
		{"named pipe", func(t testing.TB, path string) {
			replace(t, path, func(tmp string) error { return syscall.Mkfifo(tmp, 0o600) })
			// Before the fix a reader waits in open for a writer: let it go
			// when the test ends, whatever happened.
			t.Cleanup(func() {
				if fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
					syscall.Close(fd)
				}
			})
		}, "is a named pipe, not a regular file"},
		{"symlink to /dev/zero", func(t testing.TB, path string) {
			replace(t, path, func(tmp string) error { return os.Symlink("/dev/zero", tmp) })
		}, "is a device, not a regular file"},
		{"file whose reads never return", func(t testing.TB, path string) {
			replace(t, path, func(tmp string) error { return os.Symlink(hung.Path(), tmp) })
		}, "(a hung network file system?)"},
	}
}

// TestRotationUnreadableFiles: a certificate file that is a named pipe, a
// symlink to /dev/zero, or a file on a FUSE mount that never answers a read
// is refused at Wrap (which returns), and after good material it is a
// rejected reload that holds up no other identity's rotation; the hung file
// holds one read, however often it is looked at; Close returns with that
// read still outstanding.
//
// The hung file is a FUSE mount (internal/hangfs): the test needs /dev/fuse
// and the right to mount (root, as on CI), and fails saying so without them.
func TestRotationUnreadableFiles(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	must(t, err)
	// One hung file for Wrap, one for the watcher: each must hold exactly
	// one read however often it is looked at.
	var hung [2]*hangfs.FS
	for i := range hung {
		if hung[i], err = hangfs.Mount(t.TempDir()); err != nil {
			t.Fatalf("this test needs FUSE (/dev/fuse) and the right to mount it (root): %v", err)
		}
	}
	const readTimeout = 300 * time.Millisecond
	p := New(WithPollInterval(100*time.Millisecond), withDebounce(10*time.Millisecond), func(o *options) { o.readTimeout = readTimeout })
	closed := make(chan struct{})
	t.Cleanup(func() {
		// Before the fix a read hangs in the watcher until the mount is
		// gone, and Close with it: abort the mount first.
		for _, h := range hung {
			if err := h.Close(); err != nil {
				t.Error(err)
			}
		}
		select {
		case <-closed:
		default:
			p.Close()
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("at Wrap", func(t *testing.T) { unreadableAtWrap(t, p, f, hung[0]) })

	t.Run("after good material", func(t *testing.T) { unreadableAfterGood(t, ctx, p, f, hung[1], rec, dave) })

	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(10 * time.Second): // the read never returns: Close waiting for it never would
		t.Fatal("Close waits for the hung read")
	}
	if n := settledHungReads(hung[1]); n != 1 {
		t.Errorf("after Close %d reads of the hung file wait in the kernel, want the 1 Close left behind", n)
	}
}

// settledHungReads is the number of reads h holds once the read left behind
// has reached it: on a loaded machine the goroutine left with the read may
// not have sent it to the kernel yet when its caller's wait ends. It waits
// up to 10 s for one, then 100 ms more for any other.
func settledHungReads(h *hangfs.FS) int {
	for deadline := time.Now().Add(10 * time.Second); h.HungReads() == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	return h.HungReads()
}

// unreadableAtWrap is TestRotationUnreadableFiles's "at Wrap" case: every
// unreadable file, h's hung one among them, refused twice, with one read of
// the hung file left waiting.
func unreadableAtWrap(t *testing.T, p *Pool, f *fixture, h *hangfs.FS) {
	for i, u := range unreadables(h) {
		t.Run(u.name, func(t *testing.T) {
			c := writeCredFiles(t, filepath.Join(f.dir, "wrap", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
			u.make(t, c.cert)
			// The third attempt names the key inline: client-go reads such a
			// half-file pair once, and so does the pool, within the same
			// bound.
			for attempt := range 3 {
				cfg := c.config(f.srv.URL())
				if attempt == 2 {
					cfg.KeyFile, cfg.KeyData = "", f.alice.KeyPEM
				}
				wrapped := make(chan error, 1)
				go func() { wrapped <- p.Wrap(cfg) }()
				select {
				case err := <-wrapped:
					if err == nil {
						t.Fatal("Wrap succeeded")
					}
					t.Logf("attempt %d: %v", attempt+1, err)
					for _, want := range []string{c.cert, u.want} {
						if !strings.Contains(err.Error(), want) {
							t.Errorf("error does not say %q", want)
						}
					}
				case <-time.After(10 * time.Second):
					t.Fatal("Wrap did not return in 10 s")
				}
			}
		})
	}
	if n := settledHungReads(h); n != 1 {
		t.Errorf("%d reads of the hung file wait in the kernel after three Wraps, want 1", n)
	}
}

// unreadableAfterGood is TestRotationUnreadableFiles's "after good
// material" case: the unreadable files (h's hung one among them) are
// rejected reloads that hold up no other identity's rotation.
func unreadableAfterGood(t *testing.T, ctx context.Context, p *Pool, f *fixture, h *hangfs.FS, rec *cnRecorder, dave *testserver.KeyPair) {
	type badIdentity struct {
		u  unreadable
		c  *certDir
		cs *kubernetes.Clientset
	}
	var bad []badIdentity
	for i, u := range unreadables(h) {
		c := writeCredFiles(t, filepath.Join(f.dir, "after", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
		cfg := c.config(f.srv.URL())
		must(t, p.Wrap(cfg))
		cs, err := kubernetes.NewForConfig(cfg)
		must(t, err)
		bad = append(bad, badIdentity{u, c, cs})
	}
	good := newCertDir(t, renameOver, f.alice, f.ca.CertPEM())
	_, goodCS := good.wrapped(t, p, f.srv.URL())
	before := p.Stats()
	for _, b := range bad {
		b.u.make(t, b.c.cert)
	}
	// The bad reloads are under way; another identity rotates meanwhile.
	good.write(t, dave, f.ca.CertPEM())
	written := time.Now()
	waitFor(t, "the other identity's rotation", func() bool { return p.Stats().Rotations > before.Rotations })
	f.srv.CloseClientConnections()
	if _, err := goodCS.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, ok := rec.firstSince("dave", written); !ok {
		t.Error("the server did not see the rotated certificate")
	}
	waitFor(t, "every bad file rejected", func() bool {
		return p.Stats().RotationErrors >= before.RotationErrors+uint64(len(bad))
	})
	// The last good material is kept: new connections still work.
	f.srv.CloseClientConnections()
	since := time.Now()
	for _, b := range bad {
		if _, err := b.cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
			t.Errorf("%s: a client built before: %v", b.u.name, err)
		}
	}
	if _, ok := rec.firstSince("alice", since); !ok {
		t.Error("the server did not see the last good certificate")
	}
	// Each poll of the hung identity is a rejected reload of its own.
	hungCert := bad[len(bad)-1].c.cert
	rejected := func() uint64 {
		for _, info := range p.Identities() {
			if slices.Contains(info.Files, hungCert) {
				return info.RotationErrors
			}
		}
		t.Fatalf("no identity reads %s", hungCert)
		return 0
	}
	const polls = 5
	seen := rejected()
	waitFor(t, "more polls of the hung file", func() bool { return rejected() >= seen+polls })
	if n := settledHungReads(h); n != 1 {
		t.Errorf("%d reads of the hung file wait in the kernel after %d more polls, want 1", n, polls)
	}
	t.Logf("%+v", p.Stats())
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

// newInotifyFD returns the inotify descriptor opened since before, or -1.
func newInotifyFD(t testing.TB, before map[int]int) int {
	t.Helper()
	for fd := range inotifyWatches(t) {
		if _, ok := before[fd]; !ok {
			return fd
		}
	}
	return -1
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

// unwatchedDirs counts the directories p's watcher holds no watch on.
func unwatchedDirs(p *Pool) int {
	w := p.reg.watcher
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, wd := range w.dirs {
		if !wd.watched {
			n++
		}
	}
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
	if n := unwatchedDirs(p); n != 1 {
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
	waitFor(t, "the directory watched again", func() bool { return unwatchedDirs(p) == 0 })
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
	if n := unwatchedDirs(p); n != 2 {
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
	waitFor(t, "every directory watched", func() bool { return unwatchedDirs(p) == 0 })
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
	fd := -1
	for round := range rounds {
		var cfgs []*rest.Config
		for i := range perRound {
			c := writeCredFiles(t, filepath.Join(f.dir, fmt.Sprintf("%d-%d", round, i)), f.ca.CertPEM(), f.alice)
			cfg := c.config(f.srv.URL())
			must(t, p.Wrap(cfg))
			cfgs = append(cfgs, cfg)
		}
		if fd < 0 {
			fd = newInotifyFD(t, before)
		}
		if n := inotifyWatches(t)[fd]; n != perRound {
			t.Errorf("round %d: the kernel holds %d watches for %d identities in as many directories", round, n, perRound)
		}
		time.Sleep(50 * time.Millisecond) // polls run over the identities
		runtime.KeepAlive(cfgs)
		cfgs = nil
		waitReleased(t, p)
	}
	w := p.reg.watcher
	left := func() (kernel, fsnotify, pool int) {
		w.mu.Lock()
		defer w.mu.Unlock()
		return inotifyWatches(t)[fd], len(w.notify.WatchList()), len(w.dirs)
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
