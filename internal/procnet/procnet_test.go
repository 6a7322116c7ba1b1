package procnet

import (
	"net"
	"os"
	"os/exec"
	"testing"
)

func TestParse(t *testing.T) {
	const tcp = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 0100007F:1A0B 01 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 20 4 30 10 -1
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 999 1 0000000000000000 100 0 0 10 0
`
	es, err := Parse([]byte(tcp))
	if err != nil || len(es) != 2 {
		t.Fatalf("%v %v", es, err)
	}
	if e := es[0]; e.RemoteIP.String() != "127.0.0.1" || e.RemotePort != 6667 || e.LocalPort != 0x9C40 || e.State != Established || e.Inode != 12345 {
		t.Errorf("entry: %+v", e)
	}
	const tcp6 = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:A1B2 00000000000000000000000001000000:1A0B 01 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 20 4 30 10 -1
   1: 0000000000000000FFFF00000100007F:A1B2 0000000000000000FFFF00000100007F:01BB 01 00000000:00000000 00:00000000 00000000     0        0 778 1 0000000000000000 20 4 30 10 -1
`
	es, err = Parse([]byte(tcp6))
	if err != nil || len(es) != 2 {
		t.Fatalf("%v %v", es, err)
	}
	if e := es[0]; e.RemoteIP.String() != "::1" || e.RemotePort != 6667 {
		t.Errorf("entry: %+v", e)
	}
	if e := es[1]; e.RemoteIP.To4().String() != "127.0.0.1" || e.RemotePort != 443 {
		t.Errorf("v4-mapped entry: %+v %v", e, e.RemoteIP)
	}
}

// Of reads another process's descriptors: a socket this process holds is
// listed for this process's PID, and not for a child that holds none.
func TestOf(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	held := func(pid int) bool {
		conns, err := Of(pid)
		if err != nil {
			t.Fatalf("Of(%d): %v", pid, err)
		}
		for _, c := range conns {
			if c.RemotePort == port && c.State == Established {
				return true
			}
		}
		return false
	}
	if !held(os.Getpid()) {
		t.Errorf("Of(own PID) lacks the connection to port %d", port)
	}
	child := exec.Command("sleep", "10")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
	if held(child.Process.Pid) {
		t.Errorf("Of(child PID) lists this process's connection")
	}
	if _, err := Of(-1); err == nil {
		t.Errorf("Of(-1): no error")
	}
}

// A socket listed twice (the table read while it changed), one not this
// process's and one without an inode (TIME_WAIT) are dropped.
func TestAppendOwnedOnce(t *testing.T) {
	conns := []Conn{{LocalPort: 1, Inode: 10}, {LocalPort: 2, Inode: 20}, {LocalPort: 1, Inode: 10}, {LocalPort: 3, Inode: 30}, {LocalPort: 4}}
	seen := map[uint64]bool{}
	got := appendOwned(nil, conns, map[uint64]bool{10: true, 20: true}, seen)
	got = appendOwned(got, conns[:1], map[uint64]bool{10: true}, seen) // the IPv6 table names it again
	if len(got) != 2 || got[0].LocalPort != 1 || got[1].LocalPort != 2 {
		t.Errorf("got %+v, want the sockets of inodes 10 and 20, once each", got)
	}
}
