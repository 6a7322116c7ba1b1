package e2e

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"
)

// tlsRelay is a TCP relay in front of kube-apiserver that counts, for every
// connection a client opens, what the server decided: the relay accepts each
// connection the server is to get (and opens one to the server for it), and
// reads in the server's ServerHello whether the TLS handshake resumed a
// session. Nothing of the code under test is asked.
type tlsRelay struct {
	t        *testing.T
	ln       net.Listener
	upstream string

	mu        sync.Mutex // guards the fields below
	accepted  int
	peak      int
	full      int
	resumed   int
	unread    []string // connections whose handshake could not be read, and why
	conns     map[net.Conn]net.Conn
	relayDone bool

	wg sync.WaitGroup
}

// startTLSRelay relays loopback connections to 127.0.0.1:port until the test
// ends.
func startTLSRelay(t *testing.T, port int) *tlsRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &tlsRelay{t: t, ln: ln, upstream: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), conns: map[net.Conn]net.Conn{}}
	r.wg.Add(1)
	go r.serve()
	t.Cleanup(r.close)
	return r
}

// url is the address clients use in place of kube-apiserver's; its serving
// certificate names 127.0.0.1, whatever the port.
func (r *tlsRelay) url() string { return "https://" + r.ln.Addr().String() }

func (r *tlsRelay) serve() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.handle(c)
		}()
	}
}

func (r *tlsRelay) handle(c net.Conn) {
	up, err := net.Dial("tcp", r.upstream)
	if err != nil {
		c.Close()
		r.t.Errorf("relay: dial kube-apiserver: %v", err)
		return
	}
	r.mu.Lock()
	if r.relayDone {
		r.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	r.accepted++
	r.conns[c] = up
	if len(r.conns) > r.peak {
		r.peak = len(r.conns)
	}
	r.mu.Unlock()

	resumed, err := relayHellos(c, up)
	r.mu.Lock()
	switch {
	case err != nil:
		r.unread = append(r.unread, err.Error())
	case resumed:
		r.resumed++
	default:
		r.full++
	}
	r.mu.Unlock()
	if err == nil {
		done := make(chan struct{}, 2)
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			done <- struct{}{}
		}
		go pipe(up, c)
		go pipe(c, up)
		<-done // either side ended: so does the connection
	}
	c.Close()
	up.Close()
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
}

// relayHellos forwards the client's first TLS record (its ClientHello) and
// the server's (its ServerHello), and reports whether the server resumed a
// session: in TLS 1.3 its ServerHello carries the pre_shared_key extension;
// in TLS 1.2 it echoes the session ID the client offered.
func relayHellos(client, server net.Conn) (resumed bool, err error) {
	deadline := time.Now().Add(10 * time.Second)
	_ = client.SetReadDeadline(deadline)
	_ = server.SetReadDeadline(deadline)
	defer client.SetReadDeadline(time.Time{})
	defer server.SetReadDeadline(time.Time{})

	ch, err := forwardRecord(client, server)
	if err != nil {
		return false, fmt.Errorf("ClientHello: %w", err)
	}
	offered, err := clientHelloSessionID(ch)
	if err != nil {
		return false, fmt.Errorf("ClientHello: %w", err)
	}
	sh, err := forwardRecord(server, client)
	if err != nil {
		return false, fmt.Errorf("ServerHello: %w", err)
	}
	hello, err := parseServerHello(sh)
	if err != nil {
		return false, fmt.Errorf("ServerHello: %w", err)
	}
	switch {
	case hello.retry:
		return false, errors.New("ServerHello: a HelloRetryRequest, which this relay does not follow")
	case hello.version == 0x0304:
		return hello.psk, nil
	default:
		return len(offered) > 0 && bytes.Equal(hello.sessionID, offered), nil
	}
}

// forwardRecord reads one TLS handshake record from src, writes it to dst,
// and returns its body.
func forwardRecord(src, dst net.Conn) ([]byte, error) {
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(src, hdr); err != nil {
		return nil, err
	}
	if hdr[0] != 22 {
		return nil, fmt.Errorf("record type %d, want a handshake (22)", hdr[0])
	}
	body := make([]byte, binary.BigEndian.Uint16(hdr[3:]))
	if _, err := io.ReadFull(src, body); err != nil {
		return nil, err
	}
	if _, err := dst.Write(append(hdr, body...)); err != nil {
		return nil, err
	}
	return body, nil
}

// helloReader reads the fields of a hello message (RFC 8446, 4.1.2 and
// 4.1.3) in order; the first error sticks.
type helloReader struct {
	b   []byte
	err error
}

func (h *helloReader) take(n int) []byte {
	if h.err != nil {
		return nil
	}
	if n > len(h.b) {
		h.err = errors.New("message cut short")
		return nil
	}
	out := h.b[:n]
	h.b = h.b[n:]
	return out
}

func (h *helloReader) u8() int {
	b := h.take(1)
	if b == nil {
		return 0
	}
	return int(b[0])
}

func (h *helloReader) u16() int {
	b := h.take(2)
	if b == nil {
		return 0
	}
	return int(binary.BigEndian.Uint16(b))
}

// message strips the handshake header of a message of type want.
func (h *helloReader) message(want byte) {
	typ := h.u8()
	n := h.take(3)
	if h.err == nil && byte(typ) != want {
		h.err = fmt.Errorf("handshake message type %d, want %d", typ, want)
	}
	if h.err == nil {
		h.b = h.take(int(n[0])<<16 | int(n[1])<<8 | int(n[2]))
	}
}

func clientHelloSessionID(record []byte) ([]byte, error) {
	h := &helloReader{b: record}
	h.message(1)
	h.take(2 + 32) // legacy_version, random
	id := h.take(h.u8())
	return id, h.err
}

// helloRetryRandom is the random of a HelloRetryRequest (RFC 8446, 4.1.3).
var helloRetryRandom = []byte{
	0xCF, 0x21, 0xAD, 0x74, 0xE5, 0x9A, 0x61, 0x11, 0xBE, 0x1D, 0x8C, 0x02, 0x1E, 0x65, 0xB8, 0x91,
	0xC2, 0xA2, 0x11, 0x16, 0x7A, 0xBB, 0x8C, 0x5E, 0x07, 0x9E, 0x09, 0xE2, 0xC8, 0xA8, 0x33, 0x9C,
}

type serverHello struct {
	version   int // the negotiated version
	sessionID []byte
	psk       bool // the pre_shared_key extension: a TLS 1.3 resumption
	retry     bool
}

func parseServerHello(record []byte) (serverHello, error) {
	h := &helloReader{b: record}
	h.message(2)
	s := serverHello{version: h.u16()}
	s.retry = bytes.Equal(h.take(32), helloRetryRandom)
	s.sessionID = h.take(h.u8())
	h.take(2 + 1) // cipher_suite, legacy_compression_method
	if h.err != nil || len(h.b) == 0 {
		return s, h.err // TLS 1.2 without extensions
	}
	ext := &helloReader{b: h.take(h.u16())}
	for h.err == nil && ext.err == nil && len(ext.b) > 0 {
		typ := ext.u16()
		data := &helloReader{b: ext.take(ext.u16())}
		switch typ {
		case 43: // supported_versions
			s.version = data.u16()
		case 41: // pre_shared_key
			s.psk = true
		}
	}
	return s, errors.Join(h.err, ext.err)
}

// counts returns the connections accepted so far, the most open at once, and
// the full and resumed handshakes read.
func (r *tlsRelay) counts() (accepted, peak, full, resumed int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.accepted, r.peak, r.full, r.resumed
}

// open is how many connections are open now.
func (r *tlsRelay) open() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.conns)
}

// waitOpen waits until at most n connections are open and returns the
// number open at the end.
func (r *tlsRelay) waitOpen(n int, timeout time.Duration) int {
	deadline := time.Now().Add(timeout)
	for {
		got := r.open()
		if got <= n || time.Now().After(deadline) {
			return got
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// unreadHandshakes returns why handshakes could not be read, one entry each.
func (r *tlsRelay) unreadHandshakes() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.unread...)
}

func (r *tlsRelay) close() {
	r.mu.Lock()
	r.relayDone = true
	conns := r.conns
	r.conns = map[net.Conn]net.Conn{}
	r.mu.Unlock()
	r.ln.Close()
	for c, up := range conns {
		c.Close()
		up.Close()
	}
	r.wg.Wait()
}
