package e2e

import (
	"sync"
	"testing"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/procnet"
)

// Connections are counted by the kernel, not by the code under test: a
// connection is a TCP socket in /proc/net/tcp or /proc/net/tcp6 whose remote
// port is kube-apiserver's port and whose inode is one of this process's file
// descriptors (kube-apiserver's own loopback clients connect to the same port
// from another process; etcd listens elsewhere).

// openConns returns the inodes of this process's connections to the given
// remote port that are open (ESTABLISHED, or CLOSE_WAIT: the peer closed but
// this side still holds it), mapped to their local ports.
func openConns(port int) (map[uint64]int, error) {
	conns, err := procnet.Mine()
	if err != nil {
		return nil, err
	}
	out := map[uint64]int{}
	for _, c := range conns {
		if c.RemotePort == port && (c.State == procnet.Established || c.State == procnet.CloseWait) {
			out[c.Inode] = c.LocalPort
		}
	}
	return out, nil
}

// connWatch samples this process's connections to kube-apiserver while a test
// runs. Connections open when the watch started (left by earlier tests, e.g.
// client-go's own cached transports) are not counted.
type connWatch struct {
	t        *testing.T
	port     int
	baseline map[uint64]bool

	mu   sync.Mutex
	seen map[uint64]bool
	peak int

	stop chan struct{}
	done chan struct{}
}

func watchConns(t *testing.T, port int, every time.Duration) *connWatch {
	t.Helper()
	base, err := openConns(port)
	if err != nil {
		t.Fatalf("read /proc: %v", err)
	}
	w := &connWatch{t: t, port: port, baseline: map[uint64]bool{}, seen: map[uint64]bool{},
		stop: make(chan struct{}), done: make(chan struct{})}
	for ino := range base {
		w.baseline[ino] = true
	}
	go func() {
		defer close(w.done)
		tk := time.NewTicker(every)
		defer tk.Stop()
		for {
			w.sample()
			select {
			case <-w.stop:
				return
			case <-tk.C:
			}
		}
	}()
	t.Cleanup(w.Stop)
	return w
}

// sample records the connections open now and returns how many there are.
func (w *connWatch) sample() int {
	now, err := openConns(w.port)
	if err != nil {
		w.t.Errorf("read /proc: %v", err)
		return 0
	}
	n := 0
	w.mu.Lock()
	defer w.mu.Unlock()
	for ino := range now {
		if w.baseline[ino] {
			continue
		}
		n++
		w.seen[ino] = true
	}
	if n > w.peak {
		w.peak = n
	}
	return n
}

// Open samples now and returns the number of new connections open.
func (w *connWatch) Open() int { return w.sample() }

// Seen returns how many distinct new connections were observed so far, and
// the most open at once. Sampling can miss a connection that opened and
// closed between two samples, so Seen is a lower bound of connections made.
func (w *connWatch) Seen() (distinct, peak int) {
	w.sample()
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.seen), w.peak
}

func (w *connWatch) Stop() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

// waitOpen waits until at most n new connections are open and returns the
// number open at the end.
func (w *connWatch) waitOpen(n int, timeout time.Duration) int {
	deadline := time.Now().Add(timeout)
	for {
		got := w.Open()
		if got <= n || time.Now().After(deadline) {
			return got
		}
		time.Sleep(10 * time.Millisecond)
	}
}
