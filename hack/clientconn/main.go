//go:build go1.26

// Command clientconn shows why the pool does not send requests on Go 1.26's
// http.ClientConn, which would let net/http count a connection's streams
// (Available, Reserve, SetStateHook) in place of the pool's gate: a request
// that a GOAWAY turns away before the server processed it fails on a
// ClientConn, where http.Transport sends it again on another connection. The
// errors that tell such a request from one the server processed are not
// exported, so a pool on ClientConns could not resend them either.
//
// Both clients send the same load to one server, which answers 2% of the
// requests with a GOAWAY:
//
//	go run ./hack/clientconn
package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rand.Float64() < 0.02 {
			w.Header().Set("Connection", "close") // Go's HTTP/2 server sends GOAWAY
		}
		time.Sleep(time.Millisecond)
		io.WriteString(w, "ok")
	}))
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = &http.HTTP2Config{MaxConcurrentStreams: 250}
	srv.StartTLS()
	defer srv.Close()
	addr := srv.Listener.Addr().String()

	fmt.Println(runtime.Version(), "- 50 goroutines x 200 GETs, 2% of the answers with a GOAWAY")
	send("http.Transport", newTransport(), srv.URL)
	p := &clientConns{t: newTransport(), addr: addr}
	defer p.close()
	send("http.ClientConn", p, srv.URL)

	c, err := newTransport().NewClientConn(context.Background(), "https", addr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	time.Sleep(100 * time.Millisecond) // the server's SETTINGS arrive
	fmt.Printf("a new ClientConn to a server allowing 250 streams: Available() = %d\n", c.Available())
}

func newTransport() *http.Transport {
	t := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	t.Protocols = new(http.Protocols)
	t.Protocols.SetHTTP1(true)
	t.Protocols.SetHTTP2(true)
	return t
}

func send(name string, rt http.RoundTripper, url string) {
	var sent, failed atomic.Int64
	var first atomic.Value
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			for range 200 {
				sent.Add(1)
				req, err := http.NewRequest(http.MethodGet, url, nil)
				if err != nil {
					log.Fatal(err)
				}
				resp, err := rt.RoundTrip(req)
				if err != nil {
					failed.Add(1)
					first.CompareAndSwap(nil, err.Error())
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	fmt.Printf("%-16s %d requests, %d failed (first: %v)\n", name, sent.Load(), failed.Load(), first.Load())
}

// clientConns sends each request on a ClientConn with a free stream, and
// dials one when none has.
type clientConns struct {
	t     *http.Transport
	addr  string
	mu    sync.Mutex
	conns []*http.ClientConn
}

func (p *clientConns) RoundTrip(req *http.Request) (*http.Response, error) {
	p.mu.Lock()
	for _, c := range p.conns {
		if c.Reserve() == nil {
			p.mu.Unlock()
			return c.RoundTrip(req)
		}
	}
	p.mu.Unlock()
	c, err := p.t.NewClientConn(req.Context(), "https", p.addr)
	if err != nil {
		return nil, err
	}
	if err := c.Reserve(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
	return c.RoundTrip(req)
}

func (p *clientConns) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
}
