// The Pool: New, the default pool, Stats and Close. Its entry points have
// files of their own: Wrap (wrapper.go), TransportFor and HTTPClientFor
// (transportfor.go), TLSTransport (tlstransport.go), the clientcmd adapters
// (clientcmd.go).

package sharedtransport

import (
	"crypto/rand"
	"fmt"
	"sync"
	"weak"

	"k8s.io/client-go/rest"
)

// A Pool shares one HTTP transport, and so one connection pool, among all the
// [rest.Config]s it wrapped that have the same TLS identity. The zero value is
// not usable; create pools with [New]. A Pool is safe for concurrent use.
type Pool struct {
	*env
	reg *registry

	closeOnce sync.Once
	closeErr  error // what the first Close returned
}

// New returns a pool configured by opts.
func New(opts ...Option) *Pool {
	v := &env{opts: defaultOptions()}
	for _, opt := range opts {
		opt(&v.opts)
	}
	rand.Read(v.nameKey[:]) // never fails: Go 1.24's crypto/rand crashes the program instead
	return &Pool{env: v, reg: &registry{env: v, entries: make(map[identityKey]*leasedEntry), wrapped: make(map[weak.Pointer[rest.Config]]struct{})}}
}

var defaultPool = sync.OnceValue(func() *Pool { return New() })

// Default returns the package's default pool, the one [Wrap],
// [TransportFor], [HTTPClientFor], [TLSTransport] and [BuildConfigFromFlags]
// use, created with [New]'s defaults at first use. Once closed it stays
// closed, and the package-level functions return [ErrClosed].
func Default() *Pool { return defaultPool() }

// Close closes every connection of the pool, stops watching files and waits
// for the pool's goroutines to exit, a reload in a read the kernel holds
// among them. Requests sent afterwards through the pool, requests in flight
// (a dial under way stops) and reads of bodies whose connection it closed
// fail with [ErrClosed]. Every call returns once the pool is closed, with
// the first call's result.
func (p *Pool) Close() error {
	p.closeOnce.Do(func() { p.closeErr = p.reg.close() })
	return p.closeErr
}

// String summarizes the pool in one line, never its fields, which hold key
// material and change under locks.
func (p *Pool) String() string {
	st := p.Stats()
	closed := ""
	if p.isClosed() {
		closed = ", closed"
	}
	return fmt.Sprintf("sharedtransport.Pool{identities: %d, open connections: %d, dials: %d, hits: %d, misses: %d, passed through: %d%s}",
		st.Identities, st.OpenConns, st.Dials, st.Hits, st.Misses, st.PassThrough, closed)
}

// GoString keeps %#v as short as %v.
func (p *Pool) GoString() string { return p.String() }

func (p *Pool) isClosed() bool { return p.reg.isClosed() }

// Stats returns a snapshot of the pool's counters.
func (p *Pool) Stats() Stats {
	s := p.reg.sums()
	s.Hits, s.Misses = p.stats.hits.Load(), p.stats.misses.Load()
	s.PassThrough, s.WrapErrors = p.stats.passThrough.Load(), p.stats.wrapErrors.Load()
	return s
}
