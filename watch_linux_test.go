//go:build linux

package sharedtransport

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"syscall"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// mountHung mounts on dir a FUSE file system whose daemon never answers:
// the kernel holds every lookup there until the test ends, as a hung
// network mount holds its readers. It needs /dev/fuse and the privilege to
// mount, and skips saying which is missing. Ending the test aborts the
// connection, which fails the held calls, and unmounts.
func mountHung(t *testing.T, dir string) {
	t.Helper()
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no FUSE device to mount a hung file system with: %v", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := syscall.Mount("hung", dir, "fuse", syscall.MS_NOSUID|syscall.MS_NODEV, opts); err != nil {
		dev.Close()
		t.Skipf("mounting a FUSE file system was refused: %v", err)
	}
	t.Cleanup(func() {
		dev.Close() // aborts the connection: the held lookups fail
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmounting the hung file system: %v", err)
		}
	})
}

// mountTmpfs mounts a tmpfs on dir, as kubelet mounts a secret volume.
func mountTmpfs(t *testing.T, dir string) {
	t.Helper()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mounting a tmpfs was refused: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
			t.Errorf("unmounting the tmpfs: %v", err)
		}
	})
}

// TestHungMountHoldsItsOwnIdentity: identity A's files lie on a mount that
// is unmounted and mounted again with a file system whose lookups hang, as
// a hung network mount or FUSE daemon does. The poll tries to watch A's
// directory again there and waits on the kernel for good. Meanwhile a new
// identity C, whose files are on the local disk, is built and served
// through the pool as through client-go alone, and identity B's rotation
// is taken.
func TestHungMountHoldsItsOwnIdentity(t *testing.T) {
	const poll = 100 * time.Millisecond
	rec := &cnRecorder{}
	f := newFixture(t, testserver.Options{OnRequest: rec.record})
	p := newPool(t, WithPollInterval(poll))
	ctx := context.Background()

	mnt := filepath.Join(t.TempDir(), "secret")
	must(t, os.Mkdir(mnt, 0o755))
	mountTmpfs(t, mnt)
	a := writeCredFiles(t, filepath.Join(mnt, "a"), f.ca.CertPEM(), f.alice)
	aCfg := a.config(f.srv.URL())
	must(t, p.Wrap(aCfg))
	must(t, listNodes(ctx, aCfg))
	b := writeCredFiles(t, filepath.Join(t.TempDir(), "b"), f.ca.CertPEM(), f.bob)
	bCfg := b.config(f.srv.URL())
	must(t, p.Wrap(bCfg))
	must(t, listNodes(ctx, bCfg))
	aDir := filepath.Dir(a.ca)
	w := p.reg.watcher
	waitFor(t, "A's directory watched", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.dirs[aDir].watch != nil
	})

	// The kernel drops the watch with the tmpfs; the poll finds the
	// directory gone, then on the hung mount.
	must(t, syscall.Unmount(mnt, 0))
	mountHung(t, mnt)
	waitFor(t, "A's directory placed in vain for several polls", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		wd := w.dirs[aDir]
		return wd.placing && wd.again
	})
	time.Sleep(3 * poll)

	c := writeCredFiles(t, filepath.Join(t.TempDir(), "c"), f.ca.CertPEM(), f.carol)
	for _, via := range []string{"client-go alone", "the pool"} {
		cfg := c.config(f.srv.URL())
		served := make(chan error, 1)
		go func() {
			var client kubernetes.Interface
			hc, err := rest.HTTPClientFor(cfg)
			if via == "the pool" {
				hc, err = p.HTTPClientFor(cfg)
			}
			if err == nil {
				client, err = kubernetes.NewForConfigAndClient(cfg, hc)
			}
			if err == nil {
				_, err = client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
			}
			served <- err
		}()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("identity C through %s: %v", via, err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("identity C through %s: not built and served in 10 s beside the hung mount", via)
		}
	}

	since := time.Now()
	b.write(t, f.alice, f.ca.CertPEM())
	waitFor(t, "B's rotated certificate presented", func() bool {
		_ = listNodes(ctx, bCfg)
		_, ok := rec.firstSince("alice", since)
		return ok
	})
}
