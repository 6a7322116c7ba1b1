// A request through a Transports, and its response body, which keeps what sent it
// reachable and tells a retired Transports when its request ends. A request body
// is never read ahead: net/http sends a request again only with GetBody.

package conns

import (
	"fmt"
	"io"
	"net/http"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/httpstream"
)

// RoundTrip sends req. The response body keeps owner reachable: a watch runs on
// after the client that started it is gone, as with client-go alone. ErrRetired
// means t closed before req was sent, which may go on a newer Transports.
func (t *Transports) RoundTrip(req *http.Request, owner any) (*http.Response, error) {
	rt := t.shared
	if httpstream.IsUpgradeRequest(req) {
		rt = t.http1 // a connection of its own: the caller's, not a stream
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	resp.Body = t.wrapBody(resp.Body, owner)
	return resp, nil
}

// wrapBody returns body keeping owner reachable and ending its request at EOF,
// an error or Close, whichever comes first; a 101's (upgradedBody) stays writable.
func (t *Transports) wrapBody(body io.ReadCloser, owner any) io.ReadCloser {
	b := &responseBody{ReadCloser: body, owner: owner, t: t}
	if body == http.NoBody {
		b.end()
		return body
	}
	if w, ok := body.(io.Writer); ok { // net/http's 101 body: the connection, nothing more
		return &upgradedBody{b, w}
	}
	return b
}

type responseBody struct {
	io.ReadCloser
	owner any // held, never used
	t     *Transports
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
	b.t.requestEnded()
}

type upgradedBody struct {
	*responseBody
	w io.Writer
}

func (b *upgradedBody) Write(p []byte) (int, error) { return b.w.Write(p) }
