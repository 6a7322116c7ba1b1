package sharedtransport

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"golang.org/x/sync/singleflight"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"
)

// ErrClosed is returned by [Pool.Wrap] on a closed pool, and by requests sent
// through a closed pool's transports.
var ErrClosed = errors.New("sharedtransport: pool is closed")

// A Pool shares one HTTP transport, and so one connection pool, among all the
// [rest.Config]s it wrapped that have the same TLS identity. The zero value is
// not usable; create pools with [New]. A Pool is safe for concurrent use.
type Pool struct {
	opts    options
	group   singleflight.Group // one build per identity under concurrent first use
	watcher *fileWatcher       // nil until a config names certificate files
	stats   counters

	mu      sync.Mutex // guards entries, closed and watcher creation
	entries map[identityKey]*entry
	closed  bool
}

// New returns a pool configured by opts.
func New(opts ...Option) *Pool {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return &Pool{opts: o, entries: make(map[identityKey]*entry)}
}

var defaultPool = sync.OnceValue(func() *Pool { return New() })

// Wrap installs the package's default pool in cfg: the one-line drop-in for
// code that already builds a [rest.Config]. See [Pool.Wrap].
func Wrap(cfg *rest.Config) error { return defaultPool().Wrap(cfg) }

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

// Wrap makes every client built from cfg (and from copies of it that keep its
// TLS identity) share this pool's transport for that identity. It installs a
// hook as the innermost of cfg.WrapTransport, so wrappers set before or after
// Wrap still see every request, and it never sets cfg.Transport.
//
// Configs the pool cannot share pass through untouched and are counted in
// [Stats].PassThrough: a config with its own Transport, a config client-go
// would send through [http.DefaultTransport] anyway, a custom Dial without
// [WithDialIdentity], and a Proxy function that fails.
//
// Wrap reads the certificate, key and CA files cfg names, and returns an
// error naming the file when one is missing, unreadable or invalid.
func (p *Pool) Wrap(cfg *rest.Config) error {
	if p.isClosed() {
		return ErrClosed
	}
	id, err := p.identityFor(cfg)
	if err != nil {
		return err
	}
	if id == nil {
		p.stats.passThrough.Add(1)
		return nil
	}
	probe, err := probeRequest(cfg)
	if err != nil {
		return fmt.Errorf("sharedtransport: host %q: %w", redactHost(cfg.Host), err)
	}
	l, err := p.acquire(id, probe)
	if err != nil {
		return err
	}
	// The config holds its lease; the hook it carries refers to it only
	// weakly, because client-go may keep the hook for good (see hook).
	runtime.AddCleanup(cfg, holdLease, l)
	cfg.WrapTransport = transport.Wrappers(newHook(p, id, probe, l).wrap, cfg.WrapTransport)
	return nil
}

// holdLease is the cleanup that attaches a lease to a wrapped config: its
// argument stays reachable until the config is collected.
func holdLease(*lease) {}

// Close closes every connection of the pool, stops watching files and waits
// for the pool's goroutines to exit. Requests sent afterwards through configs
// the pool wrapped fail with [ErrClosed]. Close is idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	entries := p.entries
	p.entries = map[identityKey]*entry{}
	w := p.watcher
	p.mu.Unlock()

	for _, e := range entries {
		e.close()
	}
	if w != nil {
		return w.close()
	}
	return nil
}

func (p *Pool) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// Stats are plain counters of what a pool did since it was created.
type Stats struct {
	Identities     int    // identities with a live transport
	Hits           uint64 // Wrap calls that found their identity's transport
	Misses         uint64 // Wrap calls that built a transport
	PassThrough    uint64 // configs and round trippers left to client-go
	WrapErrors     uint64 // configs the [Pool.WrapConfigFn] adapter left unwrapped
	Dials          uint64 // TCP connections dialed
	OpenConns      int    // TCP connections open now
	Handshakes     uint64 // full TLS handshakes
	Resumptions    uint64 // resumed TLS handshakes
	Rotations      uint64 // certificate or CA changes taken into use
	RotationErrors uint64 // reloads rejected (the last good material was kept)
}

type counters struct {
	hits, misses, passThrough, wrapErrors atomic.Uint64
	dials, handshakes, resumptions        atomic.Uint64
	rotations, rotationErrors             atomic.Uint64
	openConns                             atomic.Int64
}

// Stats returns a snapshot of the pool's counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	n := len(p.entries)
	p.mu.Unlock()
	return Stats{
		Identities:     n,
		Hits:           p.stats.hits.Load(),
		Misses:         p.stats.misses.Load(),
		PassThrough:    p.stats.passThrough.Load(),
		WrapErrors:     p.stats.wrapErrors.Load(),
		Dials:          p.stats.dials.Load(),
		OpenConns:      int(p.stats.openConns.Load()),
		Handshakes:     p.stats.handshakes.Load(),
		Resumptions:    p.stats.resumptions.Load(),
		Rotations:      p.stats.rotations.Load(),
		RotationErrors: p.stats.rotationErrors.Load(),
	}
}

// identityKey is a digest of an identity. It is comparable, and holds no key
// material: printing it reveals nothing.
type identityKey [sha256.Size]byte

func (k identityKey) String() string { return "identity:" + hex.EncodeToString(k[:6]) }

// identity is everything that decides what a connection is and whom it
// authenticates as. It is computed once, when a config is wrapped. Per-request
// credentials (tokens, basic auth, impersonation) and the user agent are not
// part of it: client-go adds them above WrapTransport.
type identity struct {
	key identityKey

	insecure           bool
	serverName         string
	nextProtos         []string
	disableCompression bool

	// Files are watched and reloaded; inline data is fixed for the identity.
	caFile, certFile, keyFile string
	caData, certData, keyData []byte
	getCert                   *transport.GetCertHolder // exec plugin certificates

	dial func(ctx context.Context, network, address string) (net.Conn, error) // nil: client-go's default dialer

	// proxy is nil when the transport should use the environment, as
	// client-go does for configs without Proxy. Otherwise it returns the URL
	// (or nil, direct) that the config's own Proxy function gave for host,
	// and only requests to host use the shared transport.
	proxy func(*http.Request) (*url.URL, error)
	host  string
}

// watchesFiles reports whether the identity's material comes from files that
// are watched for rotation.
func (id *identity) watchesFiles() bool { return id.caFile != "" || id.certFile != "" }

// identityFor computes cfg's identity. It returns nil, nil for configs that
// pass through.
func (p *Pool) identityFor(cfg *rest.Config) (*identity, error) {
	if cfg == nil {
		return nil, errors.New("sharedtransport: Wrap called with a nil *rest.Config")
	}
	if cfg.Transport != nil {
		return nil, nil // the caller brought its own transport: never replaced
	}
	tc, err := cfg.TransportConfig()
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: %w", err)
	}
	hasTLS := tc.HasCA() || tc.HasCertAuth() || tc.HasCertCallback() || tc.TLS.Insecure ||
		tc.TLS.ServerName != "" || len(tc.TLS.NextProtos) > 0
	if !hasTLS && tc.DialHolder == nil && tc.Proxy == nil {
		return nil, nil // client-go uses http.DefaultTransport, already shared
	}
	if tc.HasCA() && tc.TLS.Insecure {
		return nil, errors.New("sharedtransport: a config cannot set both a CA and insecure: remove one of them")
	}

	id := &identity{
		insecure:           tc.TLS.Insecure,
		serverName:         tc.TLS.ServerName,
		nextProtos:         tc.TLS.NextProtos,
		disableCompression: tc.DisableCompression,
		getCert:            tc.TLS.GetCertHolder,
	}
	h := newKeyHasher()
	h.bool("insecure", id.insecure)
	h.str("serverName", id.serverName)
	// One field per protocol: joined with a separator, ["h2,x"] and
	// ["h2", "x"] would be one key for two different ALPN lists.
	h.str("nextProtos", strconv.Itoa(len(id.nextProtos)))
	for _, proto := range id.nextProtos {
		h.str("nextProto", proto)
	}
	h.bool("disableCompression", id.disableCompression)
	h.ptr("getCert", id.getCert)

	// Like client-go: files are reloaded only when named without inline data
	// (and, for the client certificate, when both halves are files).
	if tc.TLS.CAFile != "" && len(tc.TLS.CAData) == 0 {
		if id.caFile, err = filepath.Abs(tc.TLS.CAFile); err != nil {
			return nil, fmt.Errorf("sharedtransport: CA file %q: %w", tc.TLS.CAFile, err)
		}
		h.str("caFile", id.caFile)
	} else {
		id.caData = tc.TLS.CAData
		h.bytes("caData", id.caData)
	}
	switch {
	case tc.TLS.CertFile != "" && len(tc.TLS.CertData) == 0 && tc.TLS.KeyFile != "" && len(tc.TLS.KeyData) == 0:
		if id.certFile, err = filepath.Abs(tc.TLS.CertFile); err != nil {
			return nil, fmt.Errorf("sharedtransport: client certificate file %q: %w", tc.TLS.CertFile, err)
		}
		if id.keyFile, err = filepath.Abs(tc.TLS.KeyFile); err != nil {
			return nil, fmt.Errorf("sharedtransport: client key file %q: %w", tc.TLS.KeyFile, err)
		}
		h.str("certFile", id.certFile)
		h.str("keyFile", id.keyFile)
	default:
		// A mix of file and inline data is read once, as client-go does.
		if id.certData, err = dataOrFile(tc.TLS.CertData, tc.TLS.CertFile, "client certificate"); err != nil {
			return nil, err
		}
		if id.keyData, err = dataOrFile(tc.TLS.KeyData, tc.TLS.KeyFile, "client key"); err != nil {
			return nil, err
		}
		h.bytes("certData", id.certData)
		h.bytes("keyData", id.keyData)
	}

	switch {
	case cfg.Dial != nil:
		name := ""
		if p.opts.dialIdentity != nil {
			name = p.opts.dialIdentity(cfg)
		}
		if name == "" {
			return nil, nil // dialers cannot be compared: not shared unless named
		}
		// tc's dialer, not cfg.Dial: for an exec plugin config client-go
		// wraps cfg.Dial in the tracker its authenticator closes when the
		// plugin's certificate changes, and the pool's connections must
		// close with it. Otherwise the two are the same function.
		id.dial = tc.DialHolder.Dial
		h.str("dialIdentity", name)
	case tc.DialHolder != nil:
		// The exec credential plugin's dialer: one per authenticator, and
		// client-go caches authenticators, so the pointer is an identity.
		id.dial = tc.DialHolder.Dial
		h.ptr("dialHolder", tc.DialHolder)
	}

	if cfg.Proxy != nil {
		shared, err := proxyRoute(cfg)
		if err != nil {
			p.opts.logger.V(2).Info("Config passes through: its Proxy function failed", "host", redactHost(cfg.Host), "err", err)
			return nil, nil
		}
		if !shared.env {
			id.proxy = shared.fixed
			id.host = shared.host
			h.str("proxy", shared.url)
			h.str("host", shared.host)
		}
	}
	id.key = h.sum()
	return id, nil
}

type route struct {
	env   bool // the config's Proxy agrees with the environment for its host
	url   string
	host  string
	fixed func(*http.Request) (*url.URL, error)
}

// proxyRoute samples cfg.Proxy for cfg's host. Proxy functions cannot be
// compared, so two configs are taken to agree when their functions give the
// same answer for the host they talk to; the host then joins the identity. A
// config whose Proxy gives what the environment would is the same as a config
// without Proxy.
func proxyRoute(cfg *rest.Config) (route, error) {
	req, err := probeRequest(cfg)
	if err != nil {
		return route{}, err
	}
	got, err := cfg.Proxy(req)
	if err != nil {
		return route{}, err
	}
	if env, err := utilnet.NewProxierWithNoProxyCIDR(http.ProxyFromEnvironment)(req); err == nil && urlString(env) == urlString(got) {
		return route{env: true}, nil
	}
	return route{
		url:   urlString(got),
		host:  req.URL.Host,
		fixed: func(*http.Request) (*url.URL, error) { return got, nil },
	}, nil
}

// probeRequest is a request to cfg's host, for asking proxy functions where
// they would send it.
func probeRequest(cfg *rest.Config) (*http.Request, error) {
	u, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return nil, err
	}
	return &http.Request{Method: http.MethodGet, URL: u, Header: http.Header{}, Host: u.Host}, nil
}

// redactHost hides a password a config's Host may carry in its user info.
func redactHost(host string) string {
	if u, err := url.Parse(host); err == nil && u.User != nil {
		return u.Redacted()
	}
	return host
}

func urlString(u *url.URL) string {
	if u == nil {
		return "direct"
	}
	return u.String()
}

// keyHasher builds an identityKey. Every field is written with its name and
// length, so no two different identities can produce the same stream.
type keyHasher struct{ buf []byte }

func newKeyHasher() *keyHasher { return &keyHasher{} }

func (h *keyHasher) bytes(name string, b []byte) {
	h.buf = binary.AppendUvarint(h.buf, uint64(len(name)))
	h.buf = append(h.buf, name...)
	h.buf = binary.AppendUvarint(h.buf, uint64(len(b)))
	h.buf = append(h.buf, b...)
}
func (h *keyHasher) str(name, s string) { h.bytes(name, []byte(s)) }
func (h *keyHasher) bool(name string, b bool) {
	if b {
		h.str(name, "1")
	} else {
		h.str(name, "0")
	}
}

// ptr keys by address. The identity keeps what the pointer points to alive, so
// the address cannot be reused while the identity exists.
func (h *keyHasher) ptr(name string, p any) { h.str(name, fmt.Sprintf("%p", p)) }

func (h *keyHasher) sum() identityKey {
	k := identityKey(sha256.Sum256(h.buf))
	clear(h.buf) // the stream held key material
	return k
}

// entry is one identity's place in the pool: its current transport
// generation, its file watches, and how many wrapped configs refer to it.
type entry struct {
	pool    *Pool
	id      *identity
	current atomic.Pointer[generation]
	closed  atomic.Bool

	// Guarded by pool.mu.
	refs      int
	idleTimer *time.Timer
	watch     *identityWatch // nil unless id.watchesFiles()

	verifyMu sync.Mutex // serializes first looks at client-go transports (lease.matches)

	// hosts is what the identity learnt about the hosts it talks to (the
	// protocol each speaks), kept across rotations: every generation of the
	// entry shares it (keepalive.go).
	hosts hostTable

	mu       sync.Mutex // guards draining and the past credentials
	draining map[*generation]*time.Timer
	// Credentials earlier generations used, for identities with files.
	// client-go keeps its own copy of file material and refreshes it on its
	// own schedule (client certificates every 5 minutes, CAs lazily or never
	// before v0.36), so the transport it hands the hook for an unchanged
	// config may show material the pool has already rotated away from.
	pastRoots  []*x509.CertPool
	pastLeaves [][]byte
	// client-go transports already found to be this identity's. client-go
	// hands the same transport again for every config its cache can key,
	// and asking a transport for its client certificate is not free: for
	// certificate files it re-reads them and, if they changed, races
	// client-go's own refresher (client-go's dynamicClientCert returns its
	// certificate outside its lock). Weak, so the pool keeps none alive.
	recent     [8]weak.Pointer[http.Transport]
	recentNext int
}

// verified reports whether t is a client-go transport already matched to e.
func (e *entry) verified(t *http.Transport) bool {
	w := weak.Make(t)
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range e.recent {
		if r == w {
			return true
		}
	}
	return false
}

func (e *entry) remember(t *http.Transport) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.recent[e.recentNext] = weak.Make(t)
	e.recentNext = (e.recentNext + 1) % len(e.recent)
}

// maxPastCredentials bounds how many rotations back a client-go transport's
// material is still recognised as this identity's.
const maxPastCredentials = 8

// trustsRoots reports whether roots are what g trusts or, for a CA file, what
// an earlier generation trusted.
func (e *entry) trustsRoots(g *generation, roots *x509.CertPool) bool {
	if samePool(roots, g.roots) {
		return true
	}
	if e.id.caFile == "" {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.ContainsFunc(e.pastRoots, func(r *x509.CertPool) bool { return samePool(roots, r) })
}

// trustsLeaf reports whether leaf is the client certificate g presents or,
// for certificate files, one an earlier generation presented.
func (e *entry) trustsLeaf(g *generation, leaf []byte) bool {
	if bytes.Equal(leaf, g.leaf) {
		return true
	}
	if leaf != nil && g.leaf == nil && e.id.getCert != nil {
		// The exec plugin's certificate: ask the holder, as a handshake would.
		cert, err := e.id.getCert.GetCert()
		return err == nil && cert != nil && len(cert.Certificate) > 0 && bytes.Equal(leaf, cert.Certificate[0])
	}
	if e.id.certFile == "" {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.ContainsFunc(e.pastLeaves, func(l []byte) bool { return bytes.Equal(leaf, l) })
}

func samePool(a, b *x509.CertPool) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// acquire returns a lease on id's entry, building the entry on first use.
// Concurrent first uses of one identity share one build.
func (p *Pool) acquire(id *identity, probe *http.Request) (*lease, error) {
	built := false
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, ErrClosed
		}
		if e, ok := p.entries[id.key]; ok {
			p.leaseLocked(e)
			p.mu.Unlock()
			if !built {
				p.stats.hits.Add(1)
			}
			return newLease(e, probe), nil
		}
		p.mu.Unlock()

		_, err, _ := p.group.Do(string(id.key[:]), func() (any, error) {
			p.mu.Lock()
			_, ok := p.entries[id.key]
			p.mu.Unlock()
			if ok {
				return nil, nil
			}
			e, err := p.build(id)
			if err != nil {
				return nil, err
			}
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.closed {
				e.close()
				return nil, ErrClosed
			}
			p.entries[id.key] = e
			p.stats.misses.Add(1)
			built = true
			return nil, nil
		})
		if err != nil {
			return nil, err
		}
		// The entry is in the map now. In the unlikely case that it expired
		// before this goroutine took its lease, the loop builds it again.
	}
}

func (p *Pool) build(id *identity) (*entry, error) {
	m, err := loadMaterial(id)
	if err != nil {
		return nil, err
	}
	e := &entry{pool: p, id: id}
	g, err := p.newGeneration(e, m)
	if err != nil {
		return nil, err
	}
	e.current.Store(g)
	if id.watchesFiles() {
		w, err := p.fileWatcher()
		if err != nil {
			g.close()
			return nil, err
		}
		if e.watch, err = w.add(e); err != nil {
			g.close()
			return nil, err
		}
	}
	return e, nil
}

// leaseLocked counts a new reference to e and cancels a pending release.
func (p *Pool) leaseLocked(e *entry) {
	e.refs++
	if e.idleTimer != nil {
		e.idleTimer.Stop()
		e.idleTimer = nil
	}
}

// release drops a reference; runtime.AddCleanup calls it when a lease is
// garbage collected. The last reference starts the idle grace.
func (p *Pool) release(e *entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e.refs--
	if e.refs > 0 || p.closed || p.entries[e.id.key] != e {
		return
	}
	e.idleTimer = time.AfterFunc(p.opts.idleTimeout, func() { p.expire(e) })
}

func (p *Pool) expire(e *entry) {
	p.mu.Lock()
	if e.refs > 0 || p.entries[e.id.key] != e {
		p.mu.Unlock()
		return
	}
	delete(p.entries, e.id.key)
	p.mu.Unlock()
	p.opts.logger.V(4).Info("Released an identity no client uses", "identity", e.id.key)
	e.close()
}

// rotate takes g into use for new requests. The old generation closes its
// connections as they become idle and the ones still active (long watches)
// after drain, so informers re-list when the grace ends rather than all at
// the rotation.
func (e *entry) rotate(g *generation, drain time.Duration) bool {
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		g.close()
		return false
	}
	old := e.current.Swap(g)
	if e.id.caFile != "" {
		e.pastRoots = appendBounded(e.pastRoots, old.roots)
	}
	if e.id.certFile != "" {
		e.pastLeaves = appendBounded(e.pastLeaves, old.leaf)
	}
	if e.draining == nil {
		e.draining = map[*generation]*time.Timer{}
	}
	e.draining[old] = time.AfterFunc(drain, func() {
		e.mu.Lock()
		delete(e.draining, old)
		e.mu.Unlock()
		old.close()
	})
	e.mu.Unlock()
	old.retire()
	return true
}

func appendBounded[T any](s []T, v T) []T {
	if len(s) == maxPastCredentials {
		s = append(s[:0], s[1:]...)
	}
	return append(s, v)
}

// close stops e's watches and closes every connection it holds, draining
// generations included.
func (e *entry) close() {
	e.mu.Lock()
	if e.closed.Swap(true) {
		e.mu.Unlock()
		return
	}
	draining := e.draining
	e.draining = nil
	e.mu.Unlock()

	if e.watch != nil {
		e.watch.stop()
	}
	for g, t := range draining {
		t.Stop()
		g.close()
	}
	e.current.Load().close()
}

// lease is one wrapped config's hold on an entry. While a config, a copy of
// it, or any client built from them is reachable, so is its lease, and the
// entry stays. When the last lease is collected the entry's idle grace starts.
type lease struct {
	e *entry
	// probe is a request to the wrapped config's host, used to check that a
	// round tripper handed to the hook routes through the same proxy.
	probe *http.Request
}

func newLease(e *entry, probe *http.Request) *lease {
	l := &lease{e: e, probe: probe}
	runtime.AddCleanup(l, e.pool.release, e)
	return l
}
