//go:build linux

package hangfs

import (
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func TestHungRead(t *testing.T) {
	fs, err := Mount(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(fs.Path())
	if err != nil {
		t.Fatal(err)
	}
	if !fi.Mode().IsRegular() || fi.Size() != fileSize {
		t.Fatalf("%s: mode %v, size %d; want a regular file of %d bytes", fs.Path(), fi.Mode(), fi.Size(), fileSize)
	}
	f, err := os.Open(fs.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	read := make(chan error, 1)
	go func() {
		_, err := f.Read(make([]byte, 10))
		read <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for fs.HungReads() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the read never reached the file system")
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-read:
		t.Fatalf("the read returned: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := fs.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("the read succeeded after Close")
		}
		t.Logf("after Close the read returned: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the read still hangs after Close")
	}
}

// TestDyingMounter: a process that dies without Close, with a read held,
// still ends (its daemon sees it die and aborts the connection) instead of
// waiting forever on itself.
func TestDyingMounter(t *testing.T) {
	if dir := os.Getenv("HANGFS_TEST_DIE"); dir != "" {
		fs, err := Mount(dir)
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(fs.Path())
		if err != nil {
			t.Fatal(err)
		}
		go f.Read(make([]byte, 10))
		for fs.HungReads() == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		os.Exit(3) // no Close
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestDyingMounter$")
	cmd.Env = append(os.Environ(), "HANGFS_TEST_DIE="+dir)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		t.Logf("the process that mounted and died: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the process that died with a read held has not ended")
	}
	if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
		t.Errorf("unmount what the dead process left: %v", err)
	}
}
