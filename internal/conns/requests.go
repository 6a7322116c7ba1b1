// A request's way through a Transports, and its bodies: a request body of a
// known, small length is held so that net/http can send it again, and a
// response body tells a retired Transports when its request ends.

package conns

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
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
		return t.send(t.http1, req, owner) // a connection of its own: the caller's, not a stream
	}
	h := t.hosts.get(req)
	if !t.http2 {
		return t.send(t.shared, req, owner)
	}
	w, err := h.route(req.Context(), t.closedCh)
	if err != nil {
		return nil, err
	}
	rt, sent := t.shared, req
	switch {
	case w.open:
		rt = t.open
	case w.alone:
		rt, sent = t.http1, req.WithContext(req.Context())
		sent.Close = true
	}
	if w.lead != nil {
		sent = h.traceLead(req, w.lead)
	}
	resp, err := rt.RoundTrip(sent)
	if w.lead != nil {
		h.leadEnded(req.Context(), w.lead, err)
	}
	if err != nil {
		w.turn.release()
		return nil, err
	}
	resp.Request = req
	resp.Body = t.wrapBody(resp.Body, owner, h.answered(w, resp.ProtoMajor))
	return resp, nil
}

// send sends req over rt, its response body keeping owner reachable.
func (t *Transports) send(rt *http.Transport, req *http.Request, owner any) (*http.Response, error) {
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	resp.Body = t.wrapBody(resp.Body, owner, nil)
	return resp, nil
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

// wrapBody returns body keeping owner reachable and ending its request,
// turn included, at EOF, an error or Close, whichever comes first. A 101
// response's body stays writable.
func (t *Transports) wrapBody(body io.ReadCloser, owner any, turn *turn) io.ReadCloser {
	b := &responseBody{ReadCloser: body, owner: owner, t: t, turn: turn}
	if body == http.NoBody {
		b.end()
		return body
	}
	rw, ok := body.(io.ReadWriteCloser)
	switch {
	case !ok:
		return b
	case hasCloseWrite(body):
		return &upgradedBodyCloseWrite{upgradedBody{b, rw}}
	default:
		return &upgradedBody{b, rw}
	}
}

type responseBody struct {
	io.ReadCloser
	owner any // held, never used
	t     *Transports
	turn  *turn // released at the end; nil if none
	ended atomic.Bool
}

func (b *responseBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.end()
	}
	if err != nil && err != io.EOF {
		if cause := b.t.closedBy(); cause != nil {
			err = fmt.Errorf("%w while the response was read: %w", cause, err)
		}
	}
	return n, err
}

func (b *responseBody) Close() error {
	err := b.ReadCloser.Close()
	b.end()
	return err
}

func (b *responseBody) end() {
	if b.ended.Swap(true) {
		return
	}
	b.turn.release()
	b.t.requestEnded()
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
