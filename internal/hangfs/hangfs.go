//go:build linux

// Package hangfs mounts a FUSE file system whose one file, "hung", opens and
// stats like a regular file and never answers a read: what a hung network
// mount or an unresponsive FUSE daemon looks like to a reader. It speaks the
// kernel's FUSE protocol directly, as much of it as that takes, and needs the
// privilege to mount (root, or CAP_SYS_ADMIN) and /dev/fuse.
package hangfs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Name is the file whose reads never return.
const Name = "hung"

// FS is a mounted hangfs.
type FS struct {
	Dir  string
	fd   int
	stop chan struct{}
	done chan struct{}

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
	fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("hangfs: open /dev/fuse: %w", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d", fd, os.Getuid(), os.Getgid())
	if err := syscall.Mount("hangfs", dir, "fuse", syscall.MS_NOSUID|syscall.MS_NODEV, opts); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("hangfs: mount on %s: %w", dir, err)
	}
	fs := &FS{Dir: dir, fd: fd, stop: make(chan struct{}), done: make(chan struct{})}
	go fs.serve()
	return fs, nil
}

// Path is the path of the file whose reads never return.
func (fs *FS) Path() string { return filepath.Join(fs.Dir, Name) }

// HungReads returns the number of reads the file system holds unanswered.
func (fs *FS) HungReads() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.reads
}

// Close aborts the connection, so every read held fails (ENOTCONN), and
// unmounts the file system.
func (fs *FS) Close() error {
	close(fs.stop)
	<-fs.done
	// Closing the last descriptor of the device aborts the connection.
	err := syscall.Close(fs.fd)
	if uerr := syscall.Unmount(fs.Dir, syscall.MNT_DETACH); uerr != nil && err == nil {
		err = fmt.Errorf("hangfs: unmount %s: %w", fs.Dir, uerr)
	}
	return err
}

// serve answers requests until Close. It polls the device with a timeout
// rather than through Go's poller: here the device's readiness did not reach
// an edge-triggered epoll (the poller's mode), and a blocking read could not
// be interrupted by Close.
func (fs *FS) serve() {
	defer close(fs.done)
	buf := make([]byte, 1<<17) // the kernel wants room for a request of max_write bytes
	pfd := []unix.PollFd{{Fd: int32(fs.fd), Events: unix.POLLIN}}
	for {
		select {
		case <-fs.stop:
			return
		default:
		}
		if _, err := unix.Poll(pfd, 50); err != nil && !errors.Is(err, syscall.EINTR) {
			return
		}
		for {
			n, err := syscall.Read(fs.fd, buf)
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
				fs.handle(buf[:n])
			}
		}
	}
}

func (fs *FS) handle(req []byte) {
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
		fs.reply(unique, 0, out)
	case opLookup:
		name := string(body)
		if i := indexNUL(body); i >= 0 {
			name = string(body[:i])
		}
		if node != rootID || name != Name {
			fs.reply(unique, -int32(syscall.ENOENT), nil)
			return
		}
		out := make([]byte, 40+attrSize)
		le.PutUint64(out[0:], fileID)
		putAttr(out[40:], fileID)
		fs.reply(unique, 0, out)
	case opGetattr:
		if node != rootID && node != fileID {
			fs.reply(unique, -int32(syscall.ENOENT), nil)
			return
		}
		out := make([]byte, 16+attrSize)
		putAttr(out[16:], node)
		fs.reply(unique, 0, out)
	case opOpen, opOpendir:
		out := make([]byte, 16)
		le.PutUint64(out[0:], node)
		if opcode == opOpen {
			le.PutUint32(out[8:], directIO)
		}
		fs.reply(unique, 0, out)
	case opRead:
		// The point of the file system: no answer.
		fs.mu.Lock()
		fs.reads++
		fs.mu.Unlock()
	case opReaddir:
		fs.reply(unique, 0, nil) // an empty directory listing
	case opRelease, opReleasedir, opFlush:
		fs.reply(unique, 0, nil)
	case opForget, opBatchForget, opInterrupt:
		// No answer expected; an interrupted read stays unanswered.
	default:
		fs.reply(unique, -int32(syscall.ENOSYS), nil)
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

func (fs *FS) reply(unique uint64, errno int32, body []byte) {
	out := make([]byte, outHeaderSize+len(body))
	le := binary.LittleEndian
	le.PutUint32(out[0:], uint32(len(out)))
	le.PutUint32(out[4:], uint32(errno))
	le.PutUint64(out[8:], unique)
	copy(out[outHeaderSize:], body)
	_, _ = syscall.Write(fs.fd, out) // fails only once the connection is gone
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return -1
}
