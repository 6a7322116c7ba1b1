//go:build linux

// Package hangfs mounts a FUSE file system whose one file, "hung", opens and
// stats like a regular file and never answers a read: what a hung network
// mount or an unresponsive FUSE daemon looks like to a reader. It speaks the
// kernel's FUSE protocol directly, as much of it as that takes, and needs the
// privilege to mount (root, or CAP_SYS_ADMIN) and /dev/fuse.
//
// The file system is served by a child process (the same binary, started
// again: see init). A reader waiting on a FUSE answer cannot be killed, and a
// process waiting on itself could never finish exiting: if the process that
// mounted the file system dies without Close (a test timeout, a panic), the
// child sees it and exits, which fails the held reads, and the dying process
// can end.
package hangfs

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Name is the file whose reads never return.
const Name = "hung"

// daemonEnv marks the child process that serves a mount.
const daemonEnv = "HANGFS_DAEMON"

// FS is a mounted hangfs.
type FS struct {
	Dir    string
	daemon *exec.Cmd
	stdin  io.WriteCloser // closed: the daemon stops
	done   chan struct{}  // the daemon's reports are read to their end

	mu    sync.Mutex // guards reads
	reads int        // reads waiting for an answer that does not come
}

// FUSE opcodes and sizes, from include/uapi/linux/fuse.h (protocol 7.31).
const (
	opLookup      = 1
	opForget      = 2
	opGetattr     = 3
	opOpen        = 14
	opRead        = 15
	opRelease     = 18
	opFlush       = 25
	opInit        = 26
	opOpendir     = 27
	opReaddir     = 28
	opReleasedir  = 29
	opInterrupt   = 36
	opBatchForget = 42

	inHeaderSize  = 40
	outHeaderSize = 16
	attrSize      = 88

	rootID      = 1
	fileID      = 2
	fileSize    = 1024
	directIO    = 1 // FOPEN_DIRECT_IO: reads bypass the page cache and reach the daemon
	kernelMajor = 7
	kernelMinor = 31
)

// Mount mounts a hangfs on dir, which must exist.
func Mount(dir string) (*FS, error) {
	fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("hangfs: open /dev/fuse: %w", err)
	}
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	// Closed once the daemon holds its own copy: the daemon's is then the
	// last, and its exit aborts the connection.
	defer dev.Close()
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d", fd, os.Getuid(), os.Getgid())
	if err := syscall.Mount("hangfs", dir, "fuse", syscall.MS_NOSUID|syscall.MS_NODEV, opts); err != nil {
		return nil, fmt.Errorf("hangfs: mount on %s: %w", dir, err)
	}
	self, err := os.Executable()
	if err != nil {
		_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), daemonEnv+"=1")
	cmd.ExtraFiles = []*os.File{dev} // fd 3 in the daemon
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		return nil, fmt.Errorf("hangfs: start the daemon: %w", err)
	}
	fs := &FS{Dir: dir, daemon: cmd, stdin: stdin, done: make(chan struct{})}
	go fs.count(stdout)
	return fs, nil
}

// count reads the daemon's reports: a line per read it holds.
func (fs *FS) count(r io.Reader) {
	defer close(fs.done)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "read" {
			fs.mu.Lock()
			fs.reads++
			fs.mu.Unlock()
		}
	}
}

// Path is the path of the file whose reads never return.
func (fs *FS) Path() string { return filepath.Join(fs.Dir, Name) }

// HungReads returns the number of reads the file system holds unanswered.
func (fs *FS) HungReads() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.reads
}

// Close stops the daemon, which aborts the connection, so every read held
// fails (ENOTCONN), and unmounts the file system.
func (fs *FS) Close() error {
	fs.stdin.Close()
	<-fs.done
	err := fs.daemon.Wait()
	if uerr := syscall.Unmount(fs.Dir, syscall.MNT_DETACH); uerr != nil && err == nil {
		err = fmt.Errorf("hangfs: unmount %s: %w", fs.Dir, uerr)
	}
	return err
}

func init() {
	if os.Getenv(daemonEnv) == "1" {
		os.Exit(daemon())
	}
}

// daemon serves the mount whose device is fd 3 until its stdin closes or its
// parent dies, reporting each read it holds on stdout.
func daemon() int {
	stop := make(chan struct{})
	var once sync.Once
	halt := func() { once.Do(func() { close(stop) }) }
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin) // EOF: Close
		halt()
	}()
	go func() {
		// A parent that dies with a thread waiting on this file system
		// keeps its files, stdin's pipe included, open until that thread
		// ends.
		parent := os.Getppid()
		for range time.Tick(100 * time.Millisecond) {
			if os.Getppid() != parent || dying(parent) {
				halt()
				return
			}
		}
	}()
	srv := &server{fd: 3, report: func() { fmt.Println("read") }}
	if err := syscall.SetNonblock(srv.fd, true); err != nil {
		return 1
	}
	srv.serve(stop)
	return 0
}

// dying reports whether process pid is ending: exited (a zombie), or with
// SIGKILL pending, which is how exit reaches a thread that waits on a FUSE
// answer and cannot take it.
func dying(pid int) bool {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return true
	}
	const sigkill = 1 << (9 - 1)
	for _, line := range strings.Split(string(status), "\n") {
		key, value, _ := strings.Cut(line, ":")
		value = strings.TrimSpace(value)
		switch key {
		case "State":
			if strings.HasPrefix(value, "Z") || strings.HasPrefix(value, "X") {
				return true
			}
		case "SigPnd", "ShdPnd":
			if mask, err := strconv.ParseUint(value, 16, 64); err == nil && mask&sigkill != 0 {
				return true
			}
		}
	}
	return false
}

// server answers the kernel's requests on a FUSE device.
type server struct {
	fd     int
	report func() // a read is held
}

// serve answers requests until stop closes. It polls the device with a
// timeout rather than through Go's poller: here the device's readiness did
// not reach an edge-triggered epoll (the poller's mode).
func (srv *server) serve(stop <-chan struct{}) {
	buf := make([]byte, 1<<17) // the kernel wants room for a request of max_write bytes
	pfd := []unix.PollFd{{Fd: int32(srv.fd), Events: unix.POLLIN}}
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	for !stopped() {
		if _, err := unix.Poll(pfd, 50); err != nil && !errors.Is(err, syscall.EINTR) {
			return
		}
		for !stopped() {
			n, err := syscall.Read(srv.fd, buf)
			if errors.Is(err, syscall.EAGAIN) {
				break
			}
			if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.EINTR) {
				continue // an interrupted request vanished before it was read
			}
			if err != nil {
				return // the connection was aborted
			}
			if n >= inHeaderSize {
				srv.handle(buf[:n])
			}
		}
	}
}

func (srv *server) handle(req []byte) {
	le := binary.LittleEndian
	opcode := le.Uint32(req[4:])
	unique := le.Uint64(req[8:])
	node := le.Uint64(req[16:])
	body := req[inHeaderSize:]

	switch opcode {
	case opInit:
		out := make([]byte, 64)
		le.PutUint32(out[0:], kernelMajor)
		le.PutUint32(out[4:], kernelMinor)
		le.PutUint32(out[8:], 0)     // max_readahead
		le.PutUint32(out[12:], 0)    // flags
		le.PutUint16(out[16:], 16)   // max_background
		le.PutUint16(out[18:], 12)   // congestion_threshold
		le.PutUint32(out[20:], 4096) // max_write
		le.PutUint32(out[24:], 1)    // time_gran
		srv.reply(unique, 0, out)
	case opLookup:
		name := string(body)
		if i := indexNUL(body); i >= 0 {
			name = string(body[:i])
		}
		if node != rootID || name != Name {
			srv.reply(unique, -int32(syscall.ENOENT), nil)
			return
		}
		out := make([]byte, 40+attrSize)
		le.PutUint64(out[0:], fileID)
		putAttr(out[40:], fileID)
		srv.reply(unique, 0, out)
	case opGetattr:
		if node != rootID && node != fileID {
			srv.reply(unique, -int32(syscall.ENOENT), nil)
			return
		}
		out := make([]byte, 16+attrSize)
		putAttr(out[16:], node)
		srv.reply(unique, 0, out)
	case opOpen, opOpendir:
		out := make([]byte, 16)
		le.PutUint64(out[0:], node)
		if opcode == opOpen {
			le.PutUint32(out[8:], directIO)
		}
		srv.reply(unique, 0, out)
	case opRead:
		srv.report() // the point of the file system: no answer
	case opReaddir:
		srv.reply(unique, 0, nil) // an empty directory listing
	case opRelease, opReleasedir, opFlush:
		srv.reply(unique, 0, nil)
	case opForget, opBatchForget, opInterrupt:
		// No answer expected; an interrupted read stays unanswered.
	default:
		srv.reply(unique, -int32(syscall.ENOSYS), nil)
	}
}

func putAttr(b []byte, node uint64) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], node) // ino
	mode, nlink, size := uint32(syscall.S_IFDIR|0o755), uint32(2), uint64(0)
	if node == fileID {
		mode, nlink, size = syscall.S_IFREG|0o644, 1, fileSize
	}
	le.PutUint64(b[8:], size)
	le.PutUint64(b[16:], (size+511)/512) // blocks
	le.PutUint32(b[60:], mode)
	le.PutUint32(b[64:], nlink)
	le.PutUint32(b[68:], uint32(os.Getuid()))
	le.PutUint32(b[72:], uint32(os.Getgid()))
	le.PutUint32(b[80:], 4096) // blksize
}

func (srv *server) reply(unique uint64, errno int32, body []byte) {
	out := make([]byte, outHeaderSize+len(body))
	le := binary.LittleEndian
	le.PutUint32(out[0:], uint32(len(out)))
	le.PutUint32(out[4:], uint32(errno))
	le.PutUint64(out[8:], unique)
	copy(out[outHeaderSize:], body)
	_, _ = syscall.Write(srv.fd, out) // fails only once the connection is gone
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return -1
}
