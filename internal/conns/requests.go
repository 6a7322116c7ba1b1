// A request's way through a Transports, and its bodies: a request body of a
// known, small length is held so that net/http can send it again, and a
// response body holds the request's place until it ends.

package conns

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/httpstream"
)

// maxHeldBody is the largest request body held so that it can be sent
// again: a Kubernetes object is far smaller.
const maxHeldBody = 64 << 10

// RoundTrip sends req. The response body keeps owner reachable: a watch
// runs on after the client that started it is gone, as with client-go
// alone. ErrRetired means t closed before req was sent; req may then be
// sent on a newer Transports (Resendable).
func (t *Transports) RoundTrip(req *http.Request, owner any) (*http.Response, error) {
	if httpstream.IsUpgradeRequest(req) {
		return t.upgrade(req, owner)
	}
	h := t.hostFor(req)
	// Counted from before admission, so that a Transports yielding the cap
	// never closes its connections under a request it admits.
	short := t.maxConns > 0 && !longRunning(req)
	if short {
		t.shortRequests.Add(1)
	}
	p, err := h.admit(req.Context())
	if short && (err != nil || !p.counted) { // a counted body ends it
		t.requestEnded(true)
		short = false
	}
	if err != nil {
		return nil, err
	}
	if t.maxConns > 0 && p.lead {
		t.takeCap() // it may dial
	}
	sent := req
	if p.alone {
		sent = req.WithContext(req.Context())
		sent.Close = true
	}
	var ct *connTrace
	if p.trace {
		ct = &connTrace{h: h, lead: p.lead}
		sent = ct.attach(req)
	}
	resp, err := p.rt.RoundTrip(sent)
	if ct != nil {
		ct.ended(req.Context(), err)
	}
	var set *bodySet
	switch {
	case p.counted && err != nil && req.Context().Err() != nil && t.maxConns > 0 && p.rt == t.shared && h.protocol() == protoHTTP2:
		h.cancel()
	case p.counted:
		set = h.answered(p.seq, err != nil)
	}
	if err != nil {
		if short || p.counted {
			t.requestEnded(short)
		}
		return nil, err
	}
	resp.Request = req
	if !p.counted {
		h = nil
	}
	resp.Body = t.wrapBody(resp.Body, owner, h, set, short)
	return resp, nil
}

// upgrade sends an upgrade request (exec, port-forward) on a connection of
// its own: the caller's, not a stream, so it holds no place.
func (t *Transports) upgrade(req *http.Request, owner any) (*http.Response, error) {
	resp, err := t.http1.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	resp.Body = t.wrapBody(resp.Body, owner, nil, nil, false)
	return resp, nil
}

// longRunning reports whether req asks the API server for a stream that runs
// until one side ends it: a watch, a followed log.
func longRunning(req *http.Request) bool {
	raw := req.URL.RawQuery
	if !strings.Contains(raw, "watch") && !strings.Contains(raw, "follow") {
		return false // most requests: no query to parse
	}
	q := req.URL.Query()
	for _, k := range []string{"watch", "follow"} {
		if v := q.Get(k); v == "true" || v == "1" {
			return true
		}
	}
	return false
}

// Replayable gives req a GetBody when it has none and its body a known
// length up to maxHeldBody (a reverse proxy's POST): net/http resends a
// request a GOAWAY turned away only when it can get its body again.
func Replayable(req *http.Request) (*http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody || req.GetBody != nil || req.ContentLength <= 0 || req.ContentLength > maxHeldBody || httpstream.IsUpgradeRequest(req) {
		return req, nil
	}
	b, err := io.ReadAll(io.LimitReader(req.Body, req.ContentLength))
	req.Body.Close()
	if err != nil {
		return nil, err
	}
	held := req.Clone(req.Context())
	held.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	held.Body, _ = held.GetBody()
	return held, nil
}

// Resendable returns req ready to be sent again after err (ErrRetired)
// stopped it before it was sent, or err when its body cannot be had again.
func Resendable(req *http.Request, err error) (*http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return req, nil
	}
	if req.GetBody == nil {
		return nil, err
	}
	body, gerr := req.GetBody()
	if gerr != nil {
		return nil, err
	}
	again := req.Clone(req.Context())
	again.Body = body
	return again, nil
}

// wrapBody returns body keeping owner reachable. With h set, the body ends
// its request's place at EOF, an error or Close, whichever comes first. A
// 101 response's body stays writable.
func (t *Transports) wrapBody(body io.ReadCloser, owner any, h *host, set *bodySet, short bool) io.ReadCloser {
	b := responseBody{ReadCloser: body, owner: owner, t: t, h: h, set: set, short: short}
	if body == http.NoBody {
		b.end()
		return body
	}
	rw, ok := body.(io.ReadWriteCloser)
	switch {
	case !ok:
		return &b
	case hasCloseWrite(body):
		return &upgradedBodyCloseWrite{upgradedBody{&b, rw}}
	default:
		return &upgradedBody{&b, rw}
	}
}

type responseBody struct {
	io.ReadCloser
	owner any // held, never used
	t     *Transports
	h     *host    // nil: no place held
	set   *bodySet // with h: the set the body is counted in
	short bool     // with h: counted in t.shortRequests
	ended atomic.Bool
	eof   atomic.Bool // read to its end and closed underneath: reads see EOF

	closeOnce sync.Once
	closeErr  error
}

func (b *responseBody) Read(p []byte) (int, error) {
	if b.eof.Load() {
		return 0, io.EOF
	}
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case err == io.EOF:
		if b.h != nil {
			// Go frees the stream just after EOF, and Close waits for it:
			// the next request must not find the connection full.
			b.eof.Store(true)
			b.closeBody()
			b.end()
		}
	default:
		b.end()
		if cause := b.t.closedBy(); cause != nil {
			err = fmt.Errorf("%w while the response was read: %w", cause, err)
		}
	}
	return n, err
}

func (b *responseBody) Close() error {
	err := b.closeBody()
	b.end()
	return err
}

func (b *responseBody) closeBody() error {
	b.closeOnce.Do(func() { b.closeErr = b.ReadCloser.Close() })
	return b.closeErr
}

func (b *responseBody) end() {
	if b.h == nil || b.ended.Swap(true) {
		return
	}
	b.h.release(b.set)
	b.t.requestEnded(b.short)
}

// upgradedBody is a 101 response's body: the upgraded connection.
type upgradedBody struct {
	*responseBody
	w io.Writer
}

func (b *upgradedBody) Write(p []byte) (int, error) { return b.w.Write(p) }

type closeWriter interface{ CloseWrite() error }

func hasCloseWrite(body io.ReadCloser) bool {
	_, ok := body.(closeWriter)
	return ok
}

type upgradedBodyCloseWrite struct{ upgradedBody }

func (b *upgradedBodyCloseWrite) CloseWrite() error {
	return b.ReadCloser.(closeWriter).CloseWrite()
}
