package main

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// socketEntry is one line of /proc/net/tcp or /proc/net/tcp6.
type socketEntry struct {
	remoteIP   net.IP
	remotePort int
	state      int
	inode      uint64
}

const tcpEstablished = 1

// parseProcNetTCP parses the kernel's socket table format. Addresses are
// hex: IPv4 as one 32-bit word, IPv6 as four, each word in host (little
// endian on the machines this runs on) byte order.
func parseProcNetTCP(data []byte) ([]socketEntry, error) {
	var out []socketEntry
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	first := true
	for sc.Scan() {
		if first { // header
			first = false
			continue
		}
		f := strings.Fields(sc.Text())
		if len(f) < 10 {
			continue
		}
		ip, port, err := parseHexAddr(f[2])
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
		out = append(out, socketEntry{remoteIP: ip, remotePort: port, state: int(st), inode: inode})
	}
	return out, sc.Err()
}

func parseHexAddr(s string) (net.IP, int, error) {
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

// socketInodes returns the inodes of this process's sockets.
func socketInodes() (map[uint64]bool, error) {
	d, err := os.Open("/proc/self/fd")
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
		l, err := os.Readlink("/proc/self/fd/" + n)
		if err != nil || !strings.HasPrefix(l, "socket:[") {
			continue
		}
		if ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]"), 10, 64); err == nil {
			out[ino] = true
		}
	}
	return out, nil
}

// countSockets counts this process's ESTABLISHED TCP sockets whose remote
// end is one of ips at port.
func countSockets(ips map[string]bool, port int) (int, error) {
	var cand []uint64
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(file)
		if err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return 0, err
		}
		entries, err := parseProcNetTCP(b)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", file, err)
		}
		for _, e := range entries {
			if e.state != tcpEstablished || e.remotePort != port || e.inode == 0 {
				continue
			}
			ip := e.remoteIP
			if v4 := ip.To4(); v4 != nil {
				ip = v4
			}
			if ips[ip.String()] {
				cand = append(cand, e.inode)
			}
		}
	}
	if len(cand) == 0 {
		return 0, nil
	}
	mine, err := socketInodes()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, ino := range cand {
		if mine[ino] {
			n++
		}
	}
	return n, nil
}
