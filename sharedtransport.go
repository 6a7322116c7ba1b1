// The Pool API: New, Wrap, BuildConfigFromFlags, the clientcmd adapters,
// Stats and Close. What a config's identity is, is in identity.go; an
// identity's entry and its lifetime in entry.go; the hook Wrap installs in
// wrapper.go.

package sharedtransport

import (
	"fmt"
	"sync"
	"weak"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"
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
	return &Pool{env: v, reg: &registry{env: v, entries: make(map[identityKey]*held), wrapped: make(map[weak.Pointer[rest.Config]]struct{})}}
}

var defaultPool = sync.OnceValue(func() *Pool { return New() })

// Default returns the package's default pool, the one [Wrap],
// [TransportFor], [HTTPClientFor], [TLSTransport] and [BuildConfigFromFlags]
// use, created with [New]'s defaults at first use. Once closed it stays
// closed, and the package-level functions return [ErrClosed].
func Default() *Pool { return defaultPool() }

// Wrap installs the package's default pool in cfg: the one-line drop-in for
// code that already builds a [rest.Config]. See [Pool.Wrap].
func Wrap(cfg *rest.Config, opts ...CallOption) error { return defaultPool().Wrap(cfg, opts...) }

// BuildConfigFromFlags is [clientcmd.BuildConfigFromFlags] followed by
// [Wrap] on the package's default pool.
func BuildConfigFromFlags(masterURL, kubeconfigPath string) (*rest.Config, error) {
	return defaultPool().BuildConfigFromFlags(masterURL, kubeconfigPath)
}

// BuildConfigFromFlags is [clientcmd.BuildConfigFromFlags] followed by
// [Pool.Wrap].
func (p *Pool) BuildConfigFromFlags(masterURL, kubeconfigPath string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags(masterURL, kubeconfigPath)
	if err != nil {
		return nil, err
	}
	if err := p.Wrap(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}

// Wrap makes every client built from cfg, and from copies that keep its TLS
// identity, share this pool's transport for that identity. It installs a
// hook as the innermost of cfg.WrapTransport, so wrappers set before or after
// still see every request, and never sets cfg.Transport.
//
// Configs it cannot share pass through untouched, counted in
// [Stats].PassThrough: a config with its own Transport, one client-go sends
// through [http.DefaultTransport] anyway, undeclared wrappers (see
// [CallOption]), and a Proxy or Dial function, which the hook cannot tell
// from a copy's: share those with [Pool.HTTPClientFor] or
// [Pool.TransportFor], which are given the config.
//
// For a config it shares, Wrap reads the certificate, key and CA files cfg
// names; its error names the file that is missing, unreadable or invalid.
// Wrap of a config this pool wrapped already changes nothing.
func (p *Pool) Wrap(cfg *rest.Config, opts ...CallOption) error {
	return p.wrap(cfg, givenBy(opts))
}

func (p *Pool) wrap(cfg *rest.Config, g given) error {
	if p.isClosed() {
		return ErrClosed
	}
	if p.reg.wrappedBefore(cfg) {
		return nil // its hook is there, and decides for every client
	}
	s, share, err := sharingFor(cfg, g, p.opts.dialIdentity, true)
	if err != nil {
		return err
	}
	if !share {
		p.passedThrough(cfg, s.pass, s.proxyErr)
		return nil
	}
	l, err := p.reg.acquire(s.id) // reads and checks the material first: its errors name the file
	if err != nil {
		return err
	}
	// A rotation between the lease and newHook has the hook ask client-go
	// again at the first client.
	h, err := newHook(p.reg, s, l)
	if err != nil {
		return err
	}
	p.reg.holdLease(cfg, l)
	cfg.WrapTransport = transport.Wrappers(h.wrap, cfg.WrapTransport)
	return nil
}

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

// WrapConfigFn wraps cfg and returns it, in the shape of cli-runtime's
// genericclioptions.ConfigFlags.WrapConfigFn. On error it logs, counts
// [Stats].WrapErrors and returns cfg unchanged, so a CLI keeps working with
// client-go's own transport.
func (p *Pool) WrapConfigFn(cfg *rest.Config) *rest.Config {
	if err := p.Wrap(cfg); err != nil {
		p.stats.wrapErrors.Add(1)
		p.opts.logger.Error(err, "Config left unwrapped; it uses client-go's own transport")
	}
	return cfg
}

// WrapClientConfig returns a clientcmd.ClientConfig whose ClientConfig method
// returns configs wrapped by p: the drop-in for code built on
// clientcmd.NewNonInteractiveDeferredLoadingClientConfig and friends.
func (p *Pool) WrapClientConfig(cc clientcmd.ClientConfig) clientcmd.ClientConfig {
	return &clientConfig{inner: cc, pool: p}
}

// inner names the embedded clientcmd.ClientConfig.
type inner = clientcmd.ClientConfig

// clientConfig is cc with its configs wrapped by p.
type clientConfig struct {
	inner
	pool *Pool
}

func (c *clientConfig) ClientConfig() (*rest.Config, error) {
	cfg, err := c.inner.ClientConfig()
	if err != nil {
		return nil, err
	}
	if err := c.pool.Wrap(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}
