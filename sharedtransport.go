package sharedtransport

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
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

// ErrClosed is returned by [Pool.Wrap] on a closed pool, by requests sent
// through a closed pool's transports, and by requests and response bodies
// whose connection [Pool.Close] closed under them.
var ErrClosed = errors.New("sharedtransport: pool is closed")

// A Pool shares one HTTP transport, and so one connection pool, among all the
// [rest.Config]s it wrapped that have the same TLS identity. The zero value is
// not usable; create pools with [New]. A Pool is safe for concurrent use.
type Pool struct {
	opts    options
	group   singleflight.Group // one build per identity under concurrent first use
	watcher *fileWatcher       // nil until a config names certificate files
	reader  fileReader         // bounds reads of certificate files
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
	id, share, err := p.identityFor(cfg)
	if err != nil {
		return err
	}
	if !share {
		p.stats.passThrough.Add(1)
		return nil
	}
	h, err := newHook(p, id, cfg)
	if err != nil {
		return err
	}
	l, err := p.acquire(id)
	if err != nil {
		return err
	}
	h.lease = weak.Make(l)
	// The config holds its lease; the hook it carries refers to it only
	// weakly, because client-go may keep the hook for good (see hook).
	runtime.AddCleanup(cfg, holdLease, l)
	cfg.WrapTransport = transport.Wrappers(h.wrap, cfg.WrapTransport)
	return nil
}

// holdLease is the cleanup that attaches a lease to a wrapped config: its
// argument stays reachable until the config is collected.
func holdLease(*lease) {}

// Close closes every connection of the pool, stops watching files and waits
// for the pool's goroutines to exit. Requests sent afterwards through configs
// the pool wrapped fail with [ErrClosed], as do requests in flight and reads
// of response bodies whose connection it closed. Close is idempotent.
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
	// UnwatchedDirs counts the directories of certificate files watched by
	// polling alone because the kernel refused an inotify instance or watch
	// (fs.inotify.max_user_instances, max_user_watches) or the directory is
	// gone; see [WithPollInterval]. It returns to zero when their watches
	// can be set again.
	UnwatchedDirs int
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
		UnwatchedDirs:  p.unwatchedDirs(),
	}
}

func (p *Pool) unwatchedDirs() int {
	p.mu.Lock()
	w := p.watcher
	p.mu.Unlock()
	if w == nil {
		return 0
	}
	return w.unwatchedDirs()
}

// identityKey is what two configs must agree on to share a transport. It is
// a comparable struct, as client-go's tlsCacheKey is, so a field added to the
// identity is added here once and compared everywhere. Key material enters
// it as digests; its String redacts everything.
type identityKey struct {
	insecure           bool
	serverName         string
	nextProtos         string // length-prefixed, so ["h2,x"] and ["h2", "x"] differ
	disableCompression bool

	// Watched files by path; inline data, and files read once, by digest.
	caFile, certFile, keyFile string
	caData, certData, keyData digest

	getCert    *transport.GetCertHolder // an exec plugin's certificate
	dialHolder *transport.DialHolder    // an exec plugin's dialer
	dialName   string                   // a custom Dial, named by WithDialIdentity

	// proxy is "" when the transport uses the environment's proxy, as
	// client-go does for configs without Proxy; otherwise the URL the
	// config's Proxy gave for its host ("direct" for none).
	proxy string
	// connectHeader digests the headers CONNECT requests to the proxy carry
	// (proxy credentials, typically).
	connectHeader digest
}

type digest [sha256.Size]byte

func digestOf(b []byte) digest {
	if len(b) == 0 {
		return digest{}
	}
	return sha256.Sum256(b)
}

// nameSecret keys the names identities are printed with. A plain digest of a
// key would let a log reader test guesses (a proxy password) offline.
var nameSecret = sync.OnceValue(func() []byte {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return b
})

// String names the identity without revealing anything that went into it:
// an HMAC under a random per-process key. The name is stable for the process.
func (k identityKey) String() string { return "identity:" + hex.EncodeToString(k.mac()[:6]) }

func (k identityKey) mac() []byte {
	type fields identityKey // no String method: fmt prints every field
	h := hmac.New(sha256.New, nameSecret())
	fmt.Fprintf(h, "%#v", fields(k))
	return h.Sum(nil)
}

// GoString keeps %#v as redacted as %v.
func (k identityKey) GoString() string { return k.String() }

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
	// alpn is the protocol list client-go's own transport for the identity
	// offers once HTTP/2 is configured: what a client-go transport handed to
	// the hook must offer to be this identity's.
	alpn []string

	// Files are watched and reloaded; inline data is fixed for the identity.
	caFile, certFile, keyFile string
	caData, certData, keyData []byte
	getCert                   *transport.GetCertHolder // exec plugin certificates

	dial func(ctx context.Context, network, address string) (net.Conn, error) // nil: the default dialer

	// connectHeader is sent with every CONNECT request to a proxy; see
	// connectHeaderFor. headerFromWrappers says a wrapper in the config's
	// WrapTransport sets it, so client-go's transport, where a client keeps
	// it, gets it the same way.
	connectHeader      http.Header
	headerFromWrappers bool

	// clientGoKey, for certificate-file identities client-go can cache (no
	// Proxy, no Dial), is the TLS part of the config as client-go keys its
	// transport cache: the paths as the config names them.
	clientGoKey *transport.TLSConfig

	// proxy is nil when the transport uses the environment, as client-go
	// does for configs without Proxy. Otherwise it returns the URL (or nil,
	// direct) that the config's own Proxy function gave for its host.
	proxy func(*http.Request) (*url.URL, error)
}

// watchesFiles reports whether the identity's material comes from files that
// are watched for rotation.
func (id *identity) watchesFiles() bool { return id.caFile != "" || id.certFile != "" }

// identityFor computes cfg's identity. share is false for configs that pass
// through to client-go untouched: their own Transport, no TLS at all, an
// unnamed custom Dial, a Proxy function that fails.
func (p *Pool) identityFor(cfg *rest.Config) (id *identity, share bool, err error) {
	id, _, share, err = p.identityAndTransportConfig(cfg)
	return id, share, err
}

// identityAndTransportConfig is identityFor, also returning the transport
// config client-go derives from cfg (nil when cfg has its own Transport).
// TransportFor builds client-go's per-request layers from the same one, so
// that the exec plugin's certificate the identity holds and the exec
// plugin's wrapper above it come from one authenticator.
func (p *Pool) identityAndTransportConfig(cfg *rest.Config) (id *identity, tc *transport.Config, share bool, err error) {
	if cfg == nil {
		return nil, nil, false, errors.New("sharedtransport: called with a nil *rest.Config")
	}
	if cfg.Transport != nil {
		return nil, nil, false, nil // the caller brought its own transport: never replaced
	}
	if _, err := probeRequest(cfg); err != nil {
		return nil, nil, false, err
	}
	tc, err = cfg.TransportConfig()
	if err != nil {
		return nil, nil, false, fmt.Errorf("sharedtransport: %w", err)
	}
	id, share, err = p.identityOf(cfg, tc)
	return id, tc, share, err
}

// identityOf computes the identity of cfg, whose transport config is tc.
func (p *Pool) identityOf(cfg *rest.Config, tc *transport.Config) (id *identity, share bool, err error) {
	hasTLS := tc.HasCA() || tc.HasCertAuth() || tc.HasCertCallback() || tc.TLS.Insecure ||
		tc.TLS.ServerName != "" || len(tc.TLS.NextProtos) > 0
	if !hasTLS && tc.DialHolder == nil && tc.Proxy == nil {
		return nil, false, nil // client-go uses http.DefaultTransport, already shared
	}
	if tc.HasCA() && tc.TLS.Insecure {
		return nil, false, errors.New("sharedtransport: a config cannot set both a CA and insecure: remove one of them")
	}

	id = &identity{
		insecure:           tc.TLS.Insecure,
		serverName:         tc.TLS.ServerName,
		nextProtos:         tc.TLS.NextProtos,
		disableCompression: tc.DisableCompression,
		getCert:            tc.TLS.GetCertHolder,
		alpn:               clientGoALPN(tc.TLS.NextProtos, hasTLS),
	}
	if err := id.setMaterial(tc); err != nil {
		return nil, false, err
	}
	dialName, share := p.setDialer(id, cfg, tc)
	if !share {
		return nil, false, nil
	}
	if id.connectHeader, id.headerFromWrappers, share = p.connectHeaderFor(cfg); !share {
		return nil, false, nil
	}
	proxy := ""
	if cfg.Proxy != nil {
		r, err := proxyRoute(cfg)
		if err != nil {
			p.opts.logger.V(2).Info("Config passes through: its Proxy function failed", "host", redactHost(cfg.Host), "err", redactURLs(err.Error()))
			return nil, false, nil
		}
		if !r.env {
			id.proxy, proxy = r.fixed, r.url
		}
	}
	id.key = identityKey{
		insecure:           id.insecure,
		serverName:         id.serverName,
		nextProtos:         lengthPrefixed(id.nextProtos),
		disableCompression: id.disableCompression,
		caFile:             id.caFile,
		certFile:           id.certFile,
		keyFile:            id.keyFile,
		caData:             digestOf(id.caData),
		certData:           digestOf(id.certData),
		keyData:            digestOf(id.keyData),
		getCert:            id.getCert,
		dialName:           dialName,
		proxy:              proxy,
		connectHeader:      digestOf(canonicalHeader(id.connectHeader)),
	}
	if dialName == "" {
		id.key.dialHolder = tc.DialHolder // exec plugin: one per authenticator, cached by client-go
	}
	if id.certFile != "" && cfg.Proxy == nil && tc.DialHolder == nil {
		id.clientGoKey = &transport.TLSConfig{
			Insecure:   tc.TLS.Insecure,
			ServerName: tc.TLS.ServerName,
			NextProtos: tc.TLS.NextProtos,
			CAFile:     tc.TLS.CAFile,
			CAData:     tc.TLS.CAData,
			CertFile:   tc.TLS.CertFile,
			KeyFile:    tc.TLS.KeyFile,
		}
	}
	return id, true, nil
}

// setMaterial records where id's CA and client certificate come from. Like
// client-go, files are reloaded only when named without inline data (and, for
// the client certificate, when both halves are files); a mix is read once.
func (id *identity) setMaterial(tc *transport.Config) error {
	var err error
	if tc.TLS.CAFile != "" && len(tc.TLS.CAData) == 0 {
		if id.caFile, err = filepath.Abs(tc.TLS.CAFile); err != nil {
			return fmt.Errorf("sharedtransport: CA file %q: %w", tc.TLS.CAFile, err)
		}
	} else {
		id.caData = tc.TLS.CAData
	}
	if tc.TLS.CertFile != "" && len(tc.TLS.CertData) == 0 && tc.TLS.KeyFile != "" && len(tc.TLS.KeyData) == 0 {
		if id.certFile, err = filepath.Abs(tc.TLS.CertFile); err != nil {
			return fmt.Errorf("sharedtransport: client certificate file %q: %w", tc.TLS.CertFile, err)
		}
		if id.keyFile, err = filepath.Abs(tc.TLS.KeyFile); err != nil {
			return fmt.Errorf("sharedtransport: client key file %q: %w", tc.TLS.KeyFile, err)
		}
		return nil
	}
	if id.certData, err = dataOrFile(tc.TLS.CertData, tc.TLS.CertFile, "client certificate"); err != nil {
		return err
	}
	id.keyData, err = dataOrFile(tc.TLS.KeyData, tc.TLS.KeyFile, "client key")
	return err
}

// setDialer sets the dialer the identity's transport uses and returns the
// name that keys a custom Dial. share is false for a custom Dial without a
// name: dialers cannot be compared.
func (p *Pool) setDialer(id *identity, cfg *rest.Config, tc *transport.Config) (name string, share bool) {
	switch {
	case cfg.Dial != nil:
		if p.opts.dialIdentity != nil {
			name = p.opts.dialIdentity(cfg)
		}
		if name == "" {
			return "", false
		}
		// tc's dialer, not cfg.Dial: for an exec plugin config client-go
		// wraps cfg.Dial in the tracker its authenticator closes when the
		// plugin's certificate changes, and the pool's connections must
		// close with it. Otherwise the two are the same function.
		id.dial = tc.DialHolder.Dial
	case tc.DialHolder != nil:
		id.dial = tc.DialHolder.Dial // the exec plugin's tracking dialer
	}
	return name, true
}

// clientGoALPN returns the protocols a transport client-go builds for
// nextProtos offers once utilnet.SetTransportDefaults configured HTTP/2
// (DISABLE_HTTP2 included).
// Configuring HTTP/2 on a transport is most of what computing an identity
// costs, and TransportFor computes one per config: the answer is kept per
// protocol list and DISABLE_HTTP2 (callers do not modify it).
func clientGoALPN(nextProtos []string, hasTLS bool) []string {
	if !hasTLS {
		return nil
	}
	k := alpnKey{nextProtos: lengthPrefixed(nextProtos), noHTTP2: os.Getenv("DISABLE_HTTP2") != ""}
	if v, ok := alpnCache.Load(k); ok {
		return v.([]string)
	}
	t := utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: &tls.Config{NextProtos: slices.Clone(nextProtos)}})
	if alpnCached.Add(1) <= maxALPNCached {
		alpnCache.Store(k, t.TLSClientConfig.NextProtos)
	}
	return t.TLSClientConfig.NextProtos
}

type alpnKey struct {
	nextProtos string
	noHTTP2    bool
}

// maxALPNCached bounds alpnCache; configs name a few protocol lists at most.
const maxALPNCached = 64

var (
	alpnCache  sync.Map // alpnKey -> []string
	alpnCached atomic.Int64
)

func lengthPrefixed(list []string) string {
	var b []byte
	for _, s := range list {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return string(b)
}

type route struct {
	env   bool // the config's Proxy agrees with the environment for its host
	url   string
	fixed func(*http.Request) (*url.URL, error)
}

// proxyRoute samples cfg.Proxy for cfg's host. Proxy functions cannot be
// compared, so two configs are taken to agree when their functions give the
// same answer for the host they talk to. Only requests to that host ever use
// the shared transport (see hook.onlyHost); a config whose Proxy gives what
// the environment would shares the environment's transport.
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
		fixed: func(*http.Request) (*url.URL, error) { return got, nil },
	}, nil
}

// probeRequest is a request to cfg's host, for asking proxy functions where
// they would send it. Its error names the host, redacted.
func probeRequest(cfg *rest.Config) (*http.Request, error) {
	u, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: host %q is not a valid URL: fix the config's Host", redactHost(cfg.Host))
	}
	return &http.Request{Method: http.MethodGet, URL: u, Header: http.Header{}, Host: u.Host}, nil
}

// redactHost hides a password a config's Host may carry. A Host that does not
// parse is redacted by hand: everything between the scheme and the last "@"
// may be user info.
func redactHost(host string) string {
	if u, err := url.Parse(host); err == nil {
		if u.User != nil {
			return u.Redacted()
		}
		return host
	}
	rest, scheme := host, ""
	if i := strings.Index(rest, "://"); i >= 0 {
		scheme, rest = rest[:i+3], rest[i+3:]
	}
	if i := strings.LastIndex(rest, "@"); i >= 0 {
		return scheme + "xxxxx@" + rest[i+1:]
	}
	return host
}

// userInfo matches what may be a password in a URL inside free text.
var userInfo = regexp.MustCompile(`//[^/@\s"]*@`)

// redactURLs hides user info of URLs in s (a Proxy function's error may quote
// the URL it failed to parse).
func redactURLs(s string) string { return userInfo.ReplaceAllString(s, "//xxxxx@") }

func urlString(u *url.URL) string {
	if u == nil {
		return "direct"
	}
	return u.String()
}

// entry is one identity's place in the pool: its current transport
// generation, its file watches, and how many wrapped configs refer to it.
type entry struct {
	pool    *Pool
	id      *identity
	current atomic.Pointer[generation]
	since   atomic.Int64 // when current took effect, in Unix nanoseconds
	closed  atomic.Bool
	// filesBad is set while the identity's files fail to load (the last good
	// material serves meanwhile): client-go's transports would read the same
	// files, without the pool's bounds, so they are not asked.
	filesBad atomic.Bool

	// Guarded by pool.mu.
	refs      int
	idleTimer *time.Timer
	watch     *identityWatch // nil unless id.watchesFiles()

	checkMu sync.Mutex // serializes first looks at client-go transports (see clientTransport.check)

	// hosts is what the identity learnt about the hosts it talks to (the
	// protocol each speaks), kept across rotations: every generation of the
	// entry shares it (keepalive.go).
	hosts hostTable

	stats      identityCounters              // the identity's share of the pool's counters
	lastReload atomic.Pointer[reloadFailure] // the last reload rejected; nil: none

	mu       sync.Mutex // guards draining, agreed and agreedNext
	draining map[*generation]*time.Timer
	// client-go transports found to agree with a generation. client-go hands
	// the same transport again for every config its cache can key, and
	// asking a transport for its client certificate is not free. A finding
	// holds for its generation only: a rotation changes what the pool
	// presents, never what client-go's transport presents. Weak, so the pool
	// keeps no transport alive.
	agreed     [8]agreement
	agreedNext int
}

// certFileSettle is how long after a rotation client-go's transports may still
// present the certificate they read from the files before it: client-go caches
// what it reads for a second.
const certFileSettle = 1200 * time.Millisecond

// settled reports whether g took effect long enough ago that client-go's
// transports for the same certificate files present what g presents.
func (e *entry) settled(g *generation) bool {
	return e.current.Load() != g || time.Since(time.Unix(0, e.since.Load())) >= certFileSettle
}

type agreement struct {
	t    weak.Pointer[http.Transport]
	g    *generation
	dial dialFingerprint
}

// agrees reports whether t was already found to agree with g for a client
// that dials with dial.
func (e *entry) agrees(t *http.Transport, g *generation, dial dialFingerprint) bool {
	w := weak.Make(t)
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Contains(e.agreed[:], agreement{w, g, dial})
}

func (e *entry) rememberAgreement(t *http.Transport, g *generation, dial dialFingerprint) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.agreed[e.agreedNext] = agreement{weak.Make(t), g, dial}
	e.agreedNext = (e.agreedNext + 1) % len(e.agreed)
}

// acquire returns a lease on id's entry, building the entry on first use.
// Concurrent first uses of one identity share one build.
func (p *Pool) acquire(id *identity) (*lease, error) {
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
			e.checkExpiry()
			return newLease(e), nil
		}
		p.mu.Unlock()

		_, err, _ := p.group.Do(string(id.key.mac()), func() (any, error) {
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
	m, err := p.loadMaterial(id)
	if err != nil {
		return nil, err
	}
	e := &entry{pool: p, id: id}
	g, err := p.newGeneration(e, m)
	if err != nil {
		return nil, err
	}
	e.current.Store(g)
	e.since.Store(time.Now().UnixNano())
	if id.watchesFiles() {
		w, err := p.fileWatcher()
		if err != nil {
			g.close()
			return nil, err
		}
		e.watch = w.add(e)
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
	e.since.Store(time.Now().UnixNano()) // before g is visible: see settled
	old := e.current.Swap(g)
	// Findings about client-go transports were made against old.
	e.agreed = [len(e.agreed)]agreement{}
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
type lease struct{ e *entry }

func newLease(e *entry) *lease {
	l := &lease{e: e}
	runtime.AddCleanup(l, e.pool.release, e)
	return l
}
