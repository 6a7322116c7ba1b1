package main

import "github.com/sharedtransport/sharedtransport/internal/procnet"

// countSockets counts process pid's ESTABLISHED TCP sockets whose remote
// end is one of ips at port.
func countSockets(pid int, ips map[string]bool, port int) (int, error) {
	conns, err := procnet.Of(pid)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, c := range conns {
		ip := c.RemoteIP
		if v4 := ip.To4(); v4 != nil {
			ip = v4
		}
		if c.State == procnet.Established && c.RemotePort == port && ips[ip.String()] {
			n++
		}
	}
	return n, nil
}
