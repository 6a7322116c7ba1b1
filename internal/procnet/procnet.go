// Package procnet lists this process's TCP connections from the kernel's
// socket table (/proc/net/tcp and /proc/net/tcp6), so that connections are
// counted by the kernel, not by the code under test.
package procnet

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// TCP states, from include/net/tcp_states.h.
const (
	Established = 0x01
	CloseWait   = 0x08
)

// Conn is one TCP socket of the socket table.
type Conn struct {
	LocalPort  int
	RemoteIP   net.IP
	RemotePort int
	State      int
	Inode      uint64
}

// Mine returns the TCP sockets, IPv4 and IPv6, that this process holds open.
func Mine() ([]Conn, error) { return of("self") }

// Of returns the TCP sockets, IPv4 and IPv6, that process pid holds open,
// from that process's view of the socket tables (its network namespace).
// Reading another process's descriptors needs the same user, or more.
func Of(pid int) ([]Conn, error) { return of(strconv.Itoa(pid)) }

func of(proc string) ([]Conn, error) {
	owned, err := ownedInodes("/proc/" + proc + "/fd")
	if err != nil {
		return nil, err
	}
	var out []Conn
	seen := map[uint64]bool{}
	for _, file := range []string{"/proc/" + proc + "/net/tcp", "/proc/" + proc + "/net/tcp6"} {
		b, err := os.ReadFile(file)
		if err != nil {
			if os.IsNotExist(err) {
				continue // no IPv6
			}
			return nil, err
		}
		conns, err := Parse(b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		out = appendOwned(out, conns, owned, seen)
	}
	return out, nil
}

// appendOwned appends to out the sockets of conns whose inode is owned and
// not seen yet. The kernel writes its table in pieces, so a socket can be
// listed twice while others open and close; its inode names it once.
func appendOwned(out, conns []Conn, owned, seen map[uint64]bool) []Conn {
	for _, c := range conns {
		if c.Inode != 0 && owned[c.Inode] && !seen[c.Inode] {
			seen[c.Inode] = true
			out = append(out, c)
		}
	}
	return out
}

// Parse parses the socket table format. Addresses are hex: IPv4 as one
// 32-bit word, IPv6 as four, each word in host (little endian on the
// machines this runs on) byte order.
func Parse(data []byte) ([]Conn, error) {
	var out []Conn
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for first := true; sc.Scan(); first = false {
		if first { // header
			continue
		}
		f := strings.Fields(sc.Text())
		if len(f) < 10 {
			continue
		}
		_, localPort, err := parseAddr(f[1])
		if err != nil {
			return nil, err
		}
		ip, port, err := parseAddr(f[2])
		if err != nil {
			return nil, err
		}
		st, err := strconv.ParseInt(f[3], 16, 32)
		if err != nil {
			return nil, fmt.Errorf("bad state %q", f[3])
		}
		inode, err := strconv.ParseUint(f[9], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bad inode %q", f[9])
		}
		out = append(out, Conn{LocalPort: localPort, RemoteIP: ip, RemotePort: port, State: int(st), Inode: inode})
	}
	return out, sc.Err()
}

func parseAddr(s string) (net.IP, int, error) {
	host, portHex, ok := strings.Cut(s, ":")
	if !ok {
		return nil, 0, fmt.Errorf("bad address %q", s)
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil {
		return nil, 0, fmt.Errorf("bad port in %q", s)
	}
	raw, err := hex.DecodeString(host)
	if err != nil || (len(raw) != 4 && len(raw) != 16) {
		return nil, 0, fmt.Errorf("bad address %q", s)
	}
	ip := make(net.IP, len(raw))
	for w := 0; w < len(raw); w += 4 { // each 32-bit word is little endian
		ip[w], ip[w+1], ip[w+2], ip[w+3] = raw[w+3], raw[w+2], raw[w+1], raw[w]
	}
	return ip, int(port), nil
}

// ownedInodes returns the inodes of the sockets in the descriptor directory
// fdDir (/proc/PID/fd).
func ownedInodes(fdDir string) (map[uint64]bool, error) {
	d, err := os.Open(fdDir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	out := make(map[uint64]bool, len(names))
	for _, n := range names {
		link, err := os.Readlink(fdDir + "/" + n)
		if err != nil || !strings.HasPrefix(link, "socket:[") {
			continue
		}
		if ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]"), 10, 64); err == nil {
			out[ino] = true
		}
	}
	return out, nil
}
