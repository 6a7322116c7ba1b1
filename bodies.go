// Request and response bodies: a request body of a known, small length is
// held so that net/http can send it again, and a response body keeps the
// identity alive while it is read and ends its request's hold on a stream
// when it ends.

package sharedtransport

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/httpstream"
)

// maxHeldBody is the largest request body the pool holds so that it can be
// sent again: a Kubernetes object is far smaller.
const maxHeldBody = 64 << 10

// replayable gives req a GetBody when its body has a known length of at most
// maxHeldBody and none: a reverse proxy's POST, say. Without one net/http
// cannot resend a request whose body it wrote on a connection the server then
// shut down with GOAWAY without serving it, and the request fails; with one it
// resends it, as it does client-go's own requests (their bodies are byte
// readers, which give GetBody). The more requests share a connection, the more
// one GOAWAY catches.
func replayable(req *http.Request) (*http.Request, error) {
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

// resendable returns req ready to be sent again on a newer generation after
// err (errRetired) stopped it before it was sent, or err when its body cannot
// be had again.
func resendable(req *http.Request, err error) (*http.Request, error) {
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

// wrapBody returns body keeping lease l, and so the identity and its
// connections, alive while the caller holds it: a watch or a followed log
// runs on after its clientset and config are gone, as with client-go alone.
// When hc is set the body ends the request's hold on it at EOF (as Go frees
// the stream), at an error, or at Close, whichever comes first, once. The
// wrapper keeps the interfaces of the transport's body: a 101 response's body
// stays writable.
func wrapBody(body io.ReadCloser, l *lease, hc *hostConns, set *holdSet, busy bool) io.ReadCloser {
	b := leasedBody{ReadCloser: body, lease: l, hc: hc, set: set, busy: busy}
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

type leasedBody struct {
	io.ReadCloser
	lease *lease // held, never used: it is what keeps the identity alive
	hc    *hostConns
	set   *holdSet // with hc: the holds the body is counted in
	busy  bool     // with hc: counted in the generation's busy
	ended atomic.Bool
	eof   atomic.Bool // read to its end and closed underneath: reads see EOF

	closeOnce sync.Once
	closeErr  error
}

func (b *leasedBody) Read(p []byte) (int, error) {
	if b.eof.Load() {
		return 0, io.EOF
	}
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case err == io.EOF:
		if b.hc != nil {
			// Go frees the stream just after the EOF, in another
			// goroutine; Close waits for that. The hold ends once the
			// stream is free: a slot freed before it would send the next
			// request to a connection that is still full.
			b.eof.Store(true)
			b.closeBody()
			b.end()
		}
	default:
		b.end()
		if b.lease.e.closed.Load() {
			// Close cut the connection under the body: say so, as
			// RoundTrip does for a request Close cut.
			err = fmt.Errorf("%w while the response was read: %w", ErrClosed, err)
		}
	}
	return n, err
}

func (b *leasedBody) Close() error {
	err := b.closeBody()
	b.end()
	return err
}

func (b *leasedBody) closeBody() error {
	b.closeOnce.Do(func() { b.closeErr = b.ReadCloser.Close() })
	return b.closeErr
}

func (b *leasedBody) end() {
	if b.hc == nil || b.ended.Swap(true) {
		return
	}
	b.hc.release(b.set)
	if b.busy {
		b.hc.g.doneBusy()
	}
}

// upgradedBody is a 101 response's body: the upgraded connection.
type upgradedBody struct {
	*leasedBody
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
