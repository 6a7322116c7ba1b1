// What a pool shares transports by: a config's identity, which sharingFor
// computes from the config and what it is given, and identityKey compares.

package sharedtransport

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// identityKey is what two configs must agree on to share a transport: a
// comparable struct, as client-go's cache key is. Key material enters it as
// digests; its String redacts everything.
type identityKey struct {
	insecure           bool
	serverName         string
	nextProtos         string // length-prefixed, so ["h2,x"] and ["h2", "x"] differ
	disableCompression bool

	// Watched files by path; inline data, and files read once, by digest.
	caFile, certFile, keyFile string
	caData, certData, keyData digest

	getCert  *transport.GetCertHolder // an exec plugin's certificate (and dialer: one per authenticator)
	dialName string                   // a custom Dial, named by WithDialIdentity

	// proxy is "" for the environment's proxy (a config without Proxy),
	// else the URL the config's Proxy gave for its host ("direct": none).
	proxy         string
	connectHeader digest // of the headers CONNECT requests carry (proxy credentials)
	noHTTP2       bool   // DISABLE_HTTP2 when the identity was computed: its transports keep to it
	// fixedTLS keys what a TLSTransport configuration sets beyond the
	// fields above: versions, and its roots by content (rootsTable).
	fixedTLS string
}

// String never prints the key's fields: they hold digests of key material
// and proxy URLs. Logs name an identity by entry.name.
func (k identityKey) String() string { return "identityKey{redacted}" }

// GoString keeps %#v as redacted as %v.
func (k identityKey) GoString() string { return k.String() }

// mac is an HMAC of k under the pool's naming key: stable for the pool,
// revealing nothing that went into k; a plain digest would let a log reader
// test guesses (a proxy password) offline.
func (v *env) mac(k identityKey) []byte {
	type fields identityKey // no String method: fmt prints every field
	h := hmac.New(sha256.New, v.nameKey[:])
	fmt.Fprintf(h, "%#v", fields(k))
	return h.Sum(nil)
}

// nameOf is how logs and Identities name the identity keyed k.
func (v *env) nameOf(k identityKey) string { return "identity:" + hex.EncodeToString(v.mac(k)[:6]) }

// identity is everything that decides what a connection is and whom it
// authenticates as, computed once per config. Per-request credentials
// (tokens, basic auth, impersonation) and the user agent are not part of
// it: client-go adds them above WrapTransport.
type identity struct {
	key identityKey // the comparable part; the fields below build the transport

	nextProtos []string
	src        sources  // its files, watched and reloaded, and its inline material
	dial       dialFunc // nil: the default dialer
	// connectHeader goes with every CONNECT request: what the caller
	// declared its wrappers set (WithProxyConnectHeader).
	connectHeader http.Header
	tlsConfig     *tls.Config // TLSTransport's: generations use it instead of building one
	// proxy is nil for the environment's proxy; otherwise it gives what the
	// config's Proxy function gave for its host.
	proxy func(*http.Request) (*url.URL, error)
}

// watchesFiles reports whether the identity's material comes from files that
// are watched for rotation.
func (id *identity) watchesFiles() bool { return id.src.caFile != "" || id.src.certFile != "" }

// sharing is what the pool makes of one config it is given.
type sharing struct {
	id *identity
	// tc is client-go's transport config for the config (nil with a
	// Transport of its own). TransportFor builds the per-request layers
	// from it, so an exec plugin's certificate and its wrapper come from
	// one authenticator.
	tc       *transport.Config
	pass     passReason
	proxyErr error // with proxyFailed: what the Proxy function returned
}

// sharingFor computes what the pool makes of cfg. share is false for configs
// that pass through to client-go untouched: their own Transport, no TLS at
// all, an unnamed custom Dial, undeclared wrappers, a Proxy function that
// fails, and, for a config shared through Wrap's hook (viaHook), a Proxy or
// Dial function.
func sharingFor(cfg *rest.Config, g declaration, dialIdentity func(*rest.Config) string, viaHook bool) (s sharing, share bool, err error) {
	switch {
	case cfg == nil:
		return s, false, errors.New("sharedtransport: called with a nil *rest.Config")
	case cfg.Transport != nil:
		s.pass = ownTransport
		return s, false, nil
	case viaHook && (cfg.Proxy != nil || cfg.Dial != nil):
		s.pass = functionsInWrap
		return s, false, nil
	}
	req, err := hostRequest(cfg)
	if err != nil {
		return s, false, err
	}
	if s.tc, err = cfg.TransportConfig(); err != nil {
		return s, false, fmt.Errorf("sharedtransport: %w", err)
	}
	tc := s.tc
	// client-go sends a config without TLS, Dial or Proxy through
	// http.DefaultTransport, which every such config shares already.
	defaultTransport := !(tc.HasCA() || tc.HasCertAuth() || tc.HasCertCallback() || tc.TLS.Insecure ||
		tc.TLS.ServerName != "" || len(tc.TLS.NextProtos) > 0 || tc.DialHolder != nil || tc.Proxy != nil)
	switch {
	case defaultTransport:
		s.pass = noTLS
		return s, false, nil
	case tc.HasCA() && tc.TLS.Insecure:
		return s, false, errors.New("sharedtransport: a config cannot set both a CA and insecure: remove one of them")
	}
	s.id, s.pass, s.proxyErr, err = identityOf(cfg, s.tc, g, req, dialIdentity)
	return s, s.pass == shared && err == nil, err
}

// identityOf computes the identity of cfg, whose transport config is tc, or
// why it passes through. req is a request to cfg's host for its Proxy
// function; dialIdentity names a custom Dial. It neither logs nor counts: its callers do.
func identityOf(cfg *rest.Config, tc *transport.Config, g declaration, req *http.Request,
	dialIdentity func(*rest.Config) string) (id *identity, pass passReason, proxyErr, err error) {
	src, err := sourcesOf(tc)
	if err != nil {
		return nil, shared, nil, err
	}
	dial, dialName, share := dialerOf(cfg, tc, dialIdentity)
	if !share {
		return nil, unnamedDial, nil, nil
	}
	if cfg.WrapTransport != nil && !g.declared {
		return nil, undeclaredWrappers, nil, nil
	}
	r, err := proxyRoute(cfg, req)
	if err != nil {
		return nil, proxyFailed, err, nil
	}
	return &identity{
		key: identityKey{
			insecure:           tc.TLS.Insecure,
			serverName:         tc.TLS.ServerName,
			nextProtos:         lengthPrefixed(tc.TLS.NextProtos),
			disableCompression: tc.DisableCompression,
			caFile:             src.caFile,
			certFile:           src.certFile,
			keyFile:            src.keyFile,
			caData:             digestOf(src.caData),
			certData:           digestOf(src.certData),
			keyData:            digestOf(src.keyData),
			getCert:            tc.TLS.GetCertHolder,
			dialName:           dialName,
			proxy:              r.url,
			connectHeader:      headerDigest(g.connectHeader),
			noHTTP2:            noHTTP2(),
		},
		nextProtos:    tc.TLS.NextProtos,
		src:           src,
		dial:          dial,
		connectHeader: g.connectHeader,
		proxy:         r.fixed,
	}, shared, nil, nil
}

func sourcesOf(tc *transport.Config) (s sources, err error) {
	if tc.TLS.CAFile != "" && len(tc.TLS.CAData) == 0 {
		if s.caFile, err = filepath.Abs(tc.TLS.CAFile); err != nil {
			return s, fmt.Errorf("sharedtransport: CA file %q: %w", tc.TLS.CAFile, err)
		}
	} else {
		s.caData = tc.TLS.CAData
	}
	if tc.TLS.CertFile != "" && len(tc.TLS.CertData) == 0 && tc.TLS.KeyFile != "" && len(tc.TLS.KeyData) == 0 {
		if s.certFile, err = filepath.Abs(tc.TLS.CertFile); err != nil {
			return s, fmt.Errorf("sharedtransport: client certificate file %q: %w", tc.TLS.CertFile, err)
		}
		if s.keyFile, err = filepath.Abs(tc.TLS.KeyFile); err != nil {
			return s, fmt.Errorf("sharedtransport: client key file %q: %w", tc.TLS.KeyFile, err)
		}
		return s, nil
	}
	if s.certData, err = dataOrFile(tc.TLS.CertData, tc.TLS.CertFile, "client certificate"); err != nil {
		return s, err
	}
	if s.keyData, err = dataOrFile(tc.TLS.KeyData, tc.TLS.KeyFile, "client key"); err != nil {
		return s, err
	}
	if len(s.certData) == 0 || len(s.keyData) == 0 {
		s.certData, s.keyData = nil, nil // half a pair: client-go presents none
	}
	return s, nil
}

// dialerOf returns cfg's dialer (nil: the default) and the name that keys
// a custom Dial; share is false for a custom Dial without a name.
func dialerOf(cfg *rest.Config, tc *transport.Config, dialIdentity func(*rest.Config) string) (dial dialFunc, name string, share bool) {
	if cfg.Dial != nil {
		if dialIdentity != nil {
			name = dialIdentity(cfg)
		}
		if name == "" {
			return nil, "", false
		}
	}
	if tc.DialHolder != nil {
		// Not cfg.Dial: for an exec plugin, client-go wraps it in the
		// tracker that closes connections when the certificate changes.
		dial = tc.DialHolder.Dial
	}
	return dial, name, true
}

type dialFunc = func(ctx context.Context, network, address string) (net.Conn, error)

// noHTTP2 reports whether DISABLE_HTTP2 is set, as client-go reads it when
// it builds a transport.
func noHTTP2() bool { return os.Getenv("DISABLE_HTTP2") != "" }

func lengthPrefixed(list []string) string {
	var b []byte
	for _, s := range list {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return string(b)
}

// route is how a config's requests leave: the zero route is the
// environment's proxy; else fixed gives the URL (nil: direct) that keys it.
type route struct {
	url   string
	fixed func(*http.Request) (*url.URL, error)
}

// proxyRoute asks cfg.Proxy about cfg's host; without one, the route is
// the environment's. Functions cannot be compared:
// two configs agree when theirs give the same answer for their host; every
// request is then sent the way the function answers for it
// (configTransport.viaProxy). An answer the environment would give shares
// the environment's transport.
func proxyRoute(cfg *rest.Config, req *http.Request) (route, error) {
	if cfg.Proxy == nil {
		return route{}, nil
	}
	got, err := cfg.Proxy(req)
	if err != nil {
		return route{}, err
	}
	if env, err := utilnet.NewProxierWithNoProxyCIDR(http.ProxyFromEnvironment)(req); err == nil && urlString(env) == urlString(got) {
		return route{}, nil
	}
	return route{
		url:   urlString(got),
		fixed: func(*http.Request) (*url.URL, error) { return got, nil },
	}, nil
}

// hostRequest is a request to cfg's host, for cfg's Proxy function. Its
// error never quotes the host: one client-go cannot read, redactHost would
// not print either, and its text may hold a password in any shape.
func hostRequest(cfg *rest.Config) (*http.Request, error) {
	u, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: host %q is not a valid URL: fix the config's Host", unparsableURL)
	}
	return &http.Request{Method: http.MethodGet, URL: u, Header: http.Header{}, Host: u.Host}, nil
}

func urlString(u *url.URL) string {
	if u == nil {
		return "direct"
	}
	return u.String()
}

// headerDigest is how a CONNECT header enters an identity's key.
func headerDigest(h http.Header) digest { return digestOf(canonicalHeader(h)) }

// canonicalHeader encodes h so that equal headers give equal bytes.
func canonicalHeader(h http.Header) []byte {
	if len(h) == 0 {
		return nil
	}
	var b []byte
	for _, k := range slices.Sorted(maps.Keys(h)) {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(h[k])))
		for _, v := range h[k] {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return b
}
