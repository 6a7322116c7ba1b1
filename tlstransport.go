// The transport-level entry point: the pool's counterpart of the
// *http.Transport that code which never builds a rest.Config makes for
// itself (a multi-cluster apiserver's proxy to its member clusters).

package sharedtransport

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"

	utilnet "k8s.io/apimachinery/pkg/util/net"
)

// TLSTransportConfig is what a hand-built transport to one server sets,
// every field part of the identity.
type TLSTransportConfig struct {
	// TLS is the connections' TLS configuration. RootCAs,
	// InsecureSkipVerify, ServerName, NextProtos, MinVersion and MaxVersion
	// may be set; any other field is refused, since the pool cannot tell
	// two values of it apart. The pool keeps a copy. RootCAs with
	// InsecureSkipVerify is unverified, as in Go, and never shares a
	// connection with a verifying configuration.
	TLS *tls.Config
	// Proxy, when set, is the proxy every request goes through (as
	// http.ProxyURL(Proxy)); nil uses the environment's proxy as
	// utilnet.SetTransportDefaults does (HTTPS_PROXY, NO_PROXY).
	Proxy *url.URL
	// ProxyConnectHeader is sent with every CONNECT request to the proxy.
	ProxyConnectHeader http.Header
}

// TLSTransport is [Pool.TLSTransport] on the package's default pool.
func TLSTransport(c TLSTransportConfig) (http.RoundTripper, error) {
	return defaultPool().TLSTransport(c)
}

// TLSTransport returns a round tripper that sends requests over the pool's
// shared transport for c. Calls with equal settings share connections: roots
// compared with (*x509.CertPool).Equal, headers by value, the proxy by URL.
// Equal does not see constraints added with AddCertWithConstraint: pass no
// pool that has them. Other roots (a new caBundle) are another identity;
// the old one is released when no round tripper of it is left and its idle
// grace has passed ([WithIdleTimeout]). The dialer is the pool's: code that
// needs its own keeps its own transport. Keep-alive and session resumption
// are the pool's options; upgrades (exec, port-forward) get a connection of
// their own.
func (p *Pool) TLSTransport(c TLSTransportConfig) (http.RoundTripper, error) {
	if p.isClosed() {
		return nil, ErrClosed
	}
	id, err := tlsIdentity(c, &p.roots)
	if err != nil {
		return nil, err
	}
	l, err := p.reg.acquire(id)
	if err != nil {
		return nil, err
	}
	return &tlsTransport{lease: l}, nil
}

// tlsTransport is what TLSTransport returns: the identity's shared
// transport, through a lease, until a caller unwraps it.
type tlsTransport struct {
	lease   *lease
	ownOnce sync.Once
	own     *http.Transport
	// handedOut: WrappedRoundTripper gave own out: every request goes
	// through it.
	handedOut atomic.Bool
}

func (*tlsTransport) pooled() {}

func (t *tlsTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.handedOut.Load() {
		return t.own.RoundTrip(req)
	}
	return t.lease.RoundTrip(req)
}

// WrappedRoundTripper returns a transport of the caller's own, built as the
// pool builds its own, which apimachinery's UpgradeAwareHandler dials
// upgrades with: the caller may change it, and the change reaches no other
// caller. This round tripper's requests go through it from then on
// (counted in Stats.PassThrough).
func (t *tlsTransport) WrappedRoundTripper() http.RoundTripper {
	t.ownOnce.Do(func() { t.own = t.lease.ownTransport() })
	if !t.handedOut.Swap(true) {
		t.lease.countPassThrough()
	}
	return t.own
}

// CloseIdleConnections closes idle connections of both transports the round
// tripper may use.
func (t *tlsTransport) CloseIdleConnections() {
	utilnet.CloseIdleConnectionsFor(t.lease)
	if t.handedOut.Load() {
		t.own.CloseIdleConnections()
	}
}

var _ utilnet.RoundTripperWrapper = &tlsTransport{}

// tlsIdentity computes the identity of c, numbering its roots in roots.
func tlsIdentity(c TLSTransportConfig, roots *rootsTable) (*identity, error) {
	if c.TLS == nil {
		return nil, errors.New("sharedtransport: TLSTransport needs a TLS configuration: set TLSTransportConfig.TLS")
	}
	if f := tlsFieldBeyond(c.TLS, "RootCAs", "InsecureSkipVerify", "ServerName", "NextProtos", "MinVersion", "MaxVersion"); f != "" {
		return nil, fmt.Errorf("sharedtransport: TLSTransport cannot compare tls.Config.%s: leave it unset, or keep a transport of your own for this server", f)
	}
	tlsConfig := c.TLS.Clone()
	tlsConfig.NextProtos = slices.Clone(c.TLS.NextProtos) // Clone shares the slice
	if tlsConfig.RootCAs != nil {
		tlsConfig.RootCAs = tlsConfig.RootCAs.Clone() // the caller may add to its own later
	}
	var route string
	var proxy func(*http.Request) (*url.URL, error)
	if c.Proxy != nil {
		u := *c.Proxy
		route, proxy = u.String(), http.ProxyURL(&u)
	}
	return &identity{
		key: identityKey{
			insecure:      tlsConfig.InsecureSkipVerify,
			serverName:    tlsConfig.ServerName,
			nextProtos:    lengthPrefixed(tlsConfig.NextProtos),
			proxy:         route,
			connectHeader: headerDigest(c.ProxyConnectHeader),
			noHTTP2:       noHTTP2(),
			fixedTLS:      fmt.Sprintf("min=%d max=%d roots=%d", tlsConfig.MinVersion, tlsConfig.MaxVersion, roots.id(tlsConfig.RootCAs)),
		},
		nextProtos:    tlsConfig.NextProtos,
		connectHeader: c.ProxyConnectHeader.Clone(),
		tlsConfig:     tlsConfig,
		proxy:         proxy,
	}, nil
}

// tlsFieldBeyond returns the name of the first exported field of c that is
// set and not in allowed, or "".
func tlsFieldBeyond(c *tls.Config, allowed ...string) string {
	v := reflect.ValueOf(c).Elem()
	t := v.Type()
	for i := range t.NumField() {
		if f := t.Field(i); f.IsExported() && !slices.Contains(allowed, f.Name) && !v.Field(i).IsZero() {
			return f.Name
		}
	}
	return ""
}
