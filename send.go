// Sending a request on a generation, and the response bodies that keep the
// identity alive while a caller reads them.

package sharedtransport

import (
	"fmt"
	"io"
	"net/http"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/httpstream"
)

// roundTrip sends req for lease l (which the response body keeps alive).
func (g *generation) roundTrip(l *lease, req *http.Request) (*http.Response, error) {
	rt := g.transport
	if httpstream.IsUpgradeRequest(req) {
		// An upgraded connection is the caller's own: it says nothing
		// about the server's HTTP/2, and takes no turn.
		rt = g.http1
	} else {
		p := &pending{h: g.hostFor(req), ctx: req.Context()}
		if err := p.h.enter(p); err != nil {
			p.ended(err)
			return nil, err
		}
		resp, err := rt.RoundTrip(p.attach(req))
		p.ended(err)
		return g.wrapResponse(l, req, resp, err)
	}
	resp, err := rt.RoundTrip(req)
	return g.wrapResponse(l, req, resp, err)
}

func (g *generation) wrapResponse(l *lease, req *http.Request, resp *http.Response, err error) (*http.Response, error) {
	if err != nil {
		if g.retired.Load() {
			g.closeIdleSoon()
		}
		return nil, err
	}
	resp.Request = req
	resp.Body = wrapBody(resp.Body, l, g)
	return resp, nil
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
// When it ends (EOF, an error, or Close) on a retired generation g, g closes
// the connections that turned idle. The wrapper keeps the interfaces of the
// transport's body: a 101 response's body stays writable.
func wrapBody(body io.ReadCloser, l *lease, g *generation) io.ReadCloser {
	if body == http.NoBody {
		return body
	}
	b := leasedBody{ReadCloser: body, lease: l, g: g}
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
	g     *generation
	ended atomic.Bool
}

func (b *leasedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.end()
		if err != io.EOF && b.lease.e.closed.Load() {
			// Close cut the connection under the body: say so, as
			// RoundTrip does for a request Close cut.
			err = fmt.Errorf("%w while the response was read: %w", ErrClosed, err)
		}
	}
	return n, err
}

func (b *leasedBody) Close() error {
	err := b.ReadCloser.Close()
	b.end()
	return err
}

func (b *leasedBody) end() {
	if !b.ended.Swap(true) && b.g.retired.Load() {
		b.g.closeIdleSoon()
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
