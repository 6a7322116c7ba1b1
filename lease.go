// A lease as a round tripper: it sends a request through its identity's
// current generation, and moves a request a rotation closed under it
// before it was sent to the next.

package sharedtransport

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"

	utilnet "k8s.io/apimachinery/pkg/util/net"

	"github.com/sharedtransport/sharedtransport/internal/conns"
)

// pooled marks the round trippers the pool puts under client-go's layers,
// which a hook passes on as they are.
type pooled interface{ pooled() }

// RoundTrip sends req through the identity's current transports; ErrClosed
// means the pool or the identity was closed.
func (l *lease) RoundTrip(req *http.Request) (*http.Response, error) {
	return l.roundTrip(req, nil, nil)
}

// maxResends bounds how often a request is moved to a newer generation
// because its own closed before it was sent.
const maxResends = 3

// roundTrip sends req through the current generation, or through other
// when use (nil: any) refuses it. A request its generation's close refused
// before it was sent goes on the one current then.
func (l *lease) roundTrip(req *http.Request, use func(*generation) bool, other http.RoundTripper) (*http.Response, error) {
	for resends := 0; ; resends++ {
		if l.e.closed.Load() {
			return nil, fmt.Errorf("%w: build the client from a config wrapped by an open pool", ErrClosed)
		}
		g := l.e.current.Load()
		if use != nil && !use(g) {
			return other.RoundTrip(req) // not the pool's: as it came
		}
		l.e.sentTo(req.URL)
		resp, err := g.transports.RoundTrip(req, l)
		switch {
		case err == nil:
			return resp, nil
		case errors.Is(err, ErrClosed):
			return nil, err
		case l.e.closed.Load(): // rather than what the cut connection reported
			return nil, fmt.Errorf("%w while the request ran: %w", ErrClosed, err)
		case !errors.Is(err, conns.ErrRetired) || resends == maxResends:
			return nil, err
		}
		if req, err = resendable(req, err); err != nil {
			return nil, err
		}
	}
}

// resendable returns req ready to be sent again after err stopped it
// before it was sent, as net/http sends a request again: with a body only
// when GetBody gives it; err otherwise.
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

// WrappedRoundTripper lets client-go helpers (utilnet.TLSClientConfig) see
// the shared transport, which carries every request but upgrades.
func (l *lease) WrappedRoundTripper() http.RoundTripper {
	return l.e.current.Load().transports.Shared()
}

var _ utilnet.RoundTripperWrapper = &lease{}

// sharedProxy is the shared transport's answer for req: the environment's
// proxy, or the identity's route.
func (l *lease) sharedProxy(req *http.Request) (*url.URL, error) {
	return l.e.current.Load().transports.Shared().Proxy(req)
}

// ownTransport builds a transport for a caller that unwraps the pool's
// round tripper and may change it (conns.Transports.Own).
func (l *lease) ownTransport() *http.Transport { return l.e.current.Load().transports.Own() }

// material is the identity's material in use.
func (l *lease) material() *material { return l.e.current.Load().material }

// countPassThrough counts a client that goes to client-go's own transport
// from now on.
func (l *lease) countPassThrough() { l.e.env.stats.passThrough.Add(1) }

// CloseIdleConnections closes the idle connections of the identity's
// transports, other clients' included, as on client-go's shared transports.
func (l *lease) CloseIdleConnections() { l.e.current.Load().transports.CloseIdle() }
