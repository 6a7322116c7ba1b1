// Transports handed to code above the pool through WrappedRoundTripper,
// which may change them in place: every client that has one sends through
// it from then on, as without the pool.

package sharedtransport

import (
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	utilnet "k8s.io/apimachinery/pkg/util/net"
)

// handedOutTransports records, weakly, the *http.Transport under each of
// client-go's transports handed out; a record goes when it is collected.
type handedOutTransports struct {
	any atomic.Bool // there is a record: requests need not look otherwise
	mu  sync.Mutex  // guards m
	m   map[weak.Pointer[http.Transport]]struct{}
}

// add records t, the *http.Transport under a transport handed out (nil:
// none was found, nothing to record).
func (h *handedOutTransports) add(t *http.Transport) {
	if t == nil {
		return
	}
	w := weak.Make(t)
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.m[w]; ok {
		return
	}
	if h.m == nil {
		h.m = map[weak.Pointer[http.Transport]]struct{}{}
	}
	h.m[w] = struct{}{}
	h.any.Store(true)
	runtime.AddCleanup(t, h.forget, w)
}

func (h *handedOutTransports) forget(w weak.Pointer[http.Transport]) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.m, w)
}

// has reports whether the transport over t was handed out.
func (h *handedOutTransports) has(t *http.Transport) bool {
	if t == nil || !h.any.Load() {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.m[weak.Make(t)]
	return ok
}

// unwrapToTransport returns the *http.Transport under rt's wrappers, as
// client-go's helpers find it (utilnet.RoundTripperWrapper), or nil.
func unwrapToTransport(rt http.RoundTripper) *http.Transport {
	for range 8 {
		switch t := rt.(type) {
		case *http.Transport:
			return t
		case utilnet.RoundTripperWrapper:
			rt = t.WrappedRoundTripper()
		default:
			return nil
		}
	}
	return nil
}
