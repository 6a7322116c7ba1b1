//go:build linux

package sharedtransport

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/sharedtransport/sharedtransport/internal/hangfs"
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
		if err := create(tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
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
// holds one read, however often it is looked at; Close returns within a
// second.
func TestRotationUnreadableFiles(t *testing.T) {
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	dave, err := f.ca.IssueClient("dave")
	if err != nil {
		t.Fatal(err)
	}
	// One hung file for Wrap, one for the watcher: each must hold exactly
	// one read however often it is looked at.
	var hung [2]*hangfs.FS
	for i := range hung {
		if hung[i], err = hangfs.Mount(t.TempDir()); err != nil {
			t.Fatal(err)
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

	t.Run("at Wrap", func(t *testing.T) {
		for i, u := range unreadables(hung[0]) {
			t.Run(u.name, func(t *testing.T) {
				c := writeCredFiles(t, filepath.Join(f.dir, "wrap", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
				u.make(t, c.cert)
				for attempt := range 2 {
					wrapped := make(chan error, 1)
					go func() { wrapped <- p.Wrap(c.config(f.srv.URL())) }()
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
		if n := hung[0].HungReads(); n != 1 {
			t.Errorf("%d reads of the hung file wait in the kernel after two Wraps, want 1", n)
		}
	})

	t.Run("after good material", func(t *testing.T) {
		type badIdentity struct {
			u  unreadable
			c  credFiles
			cs *kubernetes.Clientset
		}
		var bad []badIdentity
		for i, u := range unreadables(hung[1]) {
			c := writeCredFiles(t, filepath.Join(f.dir, "after", string(rune('a'+i))), f.ca.CertPEM(), f.alice)
			cfg := c.config(f.srv.URL())
			if err := p.Wrap(cfg); err != nil {
				t.Fatal(err)
			}
			cs, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
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
		time.Sleep(500 * time.Millisecond) // a few more polls of the hung file
		if n := hung[1].HungReads(); n != 1 {
			t.Errorf("%d reads of the hung file wait in the kernel after %d polls, want 1", n, int(time.Since(written)/(100*time.Millisecond)))
		}
		t.Logf("%+v", p.Stats())
	})

	start := time.Now()
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Logf("Close returned in %v with a read of the hung file outstanding", time.Since(start).Round(time.Millisecond))
	case <-time.After(time.Second):
		t.Error("Close did not return within a second")
	}
}
