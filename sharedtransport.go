// The Pool API (New, Wrap, BuildConfigFromFlags, the clientcmd adapters,
// Stats, Close) and what a pool shares transports by: a config's identity,
// which identityFor computes and identityKey compares. An identity's entry
// and its lifetime are in entry.go; the hook Wrap installs is in wrapper.go,
// and what it reads from client-go's transports in inspect.go.

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
	"weak"

	"golang.org/x/sync/singleflight"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/transport"
)

// ErrClosed is returned by [Pool.Wrap] and [Pool.TransportFor] on a closed
// pool, by requests sent through a closed pool's transports, and by requests
// and response bodies whose connection [Pool.Close] closed under them.
var ErrClosed = errors.New("sharedtransport: pool is closed")

// A Pool shares one HTTP transport, and so one connection pool, among all the
// [rest.Config]s it wrapped that have the same TLS identity. The zero value is
// not usable; create pools with [New]. A Pool is safe for concurrent use.
type Pool struct {
	opts   options
	group  singleflight.Group // one build per identity under concurrent first use
	reader fileReader         // bounds reads of certificate files
	stats  counters

	mu      sync.Mutex // guards entries, closed, watcher, and every entry's refs and idleTimer
	entries map[identityKey]*entry
	closed  bool
	watcher *fileWatcher // nil until a config names certificate files

	closeOnce sync.Once
	closeErr  error // what the first Close returned
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

// Close closes every connection of the pool, stops watching files and waits
// for the pool's goroutines to exit. Requests sent afterwards through configs
// the pool wrapped fail with [ErrClosed], as do requests in flight and reads
// of response bodies whose connection it closed. Close is idempotent: every
// call, concurrent ones included, returns once the pool is closed, with the
// first call's result.
func (p *Pool) Close() error {
	p.closeOnce.Do(func() { p.closeErr = p.shutdown() })
	return p.closeErr
}

func (p *Pool) shutdown() error {
	p.mu.Lock()
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
	Identities int // identities with a live transport

	// Hits and Misses count the lookups of an identity's transport: one per
	// [Pool.Wrap] and [Pool.TransportFor] of a config the pool shares, and
	// one when a wrapped config's hook takes its identity again for a new
	// client after the identity was released (see [WithIdleTimeout]). A
	// miss built the transport; a hit found it, or waited for a concurrent
	// lookup of the same identity to build it.
	Hits   uint64
	Misses uint64
	// PassThrough counts configs and clients left to client-go's own
	// transport, in one number: each config [Pool.Wrap] or
	// [Pool.TransportFor] does not share (see [Pool.Wrap]), and each client
	// of a wrapped config that keeps client-go's transport (a SPDY or
	// websocket round tripper, a copy of the config whose TLS identity
	// differs, a client built while the identity's files fail to load). A
	// client counts once, however many requests it sends.
	PassThrough uint64

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

type clientConfig struct {
	inner clientcmd.ClientConfig
	pool  *Pool
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

func (c *clientConfig) RawConfig() (clientcmdapi.Config, error) { return c.inner.RawConfig() }

func (c *clientConfig) Namespace() (string, bool, error) { return c.inner.Namespace() }

func (c *clientConfig) ConfigAccess() clientcmd.ConfigAccess { return c.inner.ConfigAccess() }

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
	// fixedTLS keys what a TLSTransport configuration sets beyond the
	// fields above: versions, and its roots by content (see rootsID).
	fixedTLS string
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

	// tlsConfig, set for TLSTransport identities, is the caller's TLS
	// configuration: generations use a copy of it instead of building one.
	tlsConfig *tls.Config

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
		return nil, nil, false, nil // pass through: the caller's own Transport is never replaced
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
// share is false, with a nil identity, for a config that passes through.
func (p *Pool) identityOf(cfg *rest.Config, tc *transport.Config) (id *identity, share bool, err error) {
	hasTLS := tc.HasCA() || tc.HasCertAuth() || tc.HasCertCallback() || tc.TLS.Insecure ||
		tc.TLS.ServerName != "" || len(tc.TLS.NextProtos) > 0
	if !hasTLS && tc.DialHolder == nil && tc.Proxy == nil {
		return nil, false, nil // pass through: client-go uses http.DefaultTransport, already shared
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
		return nil, false, nil // pass through: a custom Dial WithDialIdentity does not name
	}
	if id.connectHeader, id.headerFromWrappers, share = p.connectHeaderFor(cfg); !share {
		return nil, false, nil // pass through: wrappers that replace the transport
	}
	proxy, share := p.setProxy(id, cfg)
	if !share {
		return nil, false, nil // pass through: a Proxy function that fails
	}
	id.key = id.keyFor(dialName, proxy)
	if dialName == "" {
		id.key.dialHolder = tc.DialHolder // exec plugin: one per authenticator, cached by client-go
	}
	if id.certFile != "" && cfg.Proxy == nil && tc.DialHolder == nil {
		id.clientGoKey = clientGoKey(tc)
	}
	return id, true, nil
}

// setProxy sets the proxy function of id's transport from cfg.Proxy, and
// returns the route that keys it (see identityKey.proxy). share is false when
// cfg.Proxy fails.
func (p *Pool) setProxy(id *identity, cfg *rest.Config) (proxy string, share bool) {
	if cfg.Proxy == nil {
		return "", true
	}
	r, err := proxyRoute(cfg)
	if err != nil {
		p.opts.logger.V(2).Info("Config passes through: its Proxy function failed", "host", redactHost(cfg.Host), "err", redactURLs(err.Error()))
		return "", false
	}
	if r.env {
		return "", true
	}
	id.proxy = r.fixed
	return r.url, true
}

// keyFor returns id's key, for a custom Dial named dialName and a proxy
// route proxy.
func (id *identity) keyFor(dialName, proxy string) identityKey {
	return identityKey{
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
}

// clientGoKey returns the TLS part of tc as client-go keys its transport
// cache: see identity.clientGoKey.
func clientGoKey(tc *transport.Config) *transport.TLSConfig {
	return &transport.TLSConfig{
		Insecure:   tc.TLS.Insecure,
		ServerName: tc.TLS.ServerName,
		NextProtos: tc.TLS.NextProtos,
		CAFile:     tc.TLS.CAFile,
		CAData:     tc.TLS.CAData,
		CertFile:   tc.TLS.CertFile,
		KeyFile:    tc.TLS.KeyFile,
	}
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
	alpn := settledALPN(t)
	if alpnCached.Add(1) <= maxALPNCached {
		alpnCache.Store(k, alpn)
	}
	return alpn
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

// redactHost hides a password a config's Host (or a proxy URL) may carry. A
// user name without a password is hidden too: it is the credential itself
// (a token as user name, as some proxies take it). A Host that does not
// parse is redacted by hand: everything between the scheme and the last "@"
// may be user info.
func redactHost(host string) string {
	if u, err := url.Parse(host); err == nil {
		if u.User == nil {
			return host
		}
		if pw, ok := u.User.Password(); !ok || pw == "" {
			r := *u
			r.User = url.User("xxxxx")
			return r.String()
		}
		return u.Redacted()
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
