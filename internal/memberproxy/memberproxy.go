// Package memberproxy is the front of an aggregated API server that proxies
// requests to member clusters, in the shape of Karmada's cluster proxy
// (karmada pkg/util/proxy): for every request it reads the member's Secret,
// builds a [rest.Config] from it, gets a round tripper and forwards the
// request with apimachinery's [proxy.UpgradeAwareHandler].
//
// How the round tripper is obtained is the point of comparison (see [Mode]):
// a new transport per request, as Karmada did (issue 5574: 3,000 connections
// to one member), the same with keep-alive off, as Karmada does since PR
// 5610, or a sharedtransport pool's TransportFor in place of
// [rest.TransportFor], the one line Karmada would change.
//
// The library's tests and cmd/conncount use it; example_proxy_test.go shows
// the same pattern in a few lines.
package memberproxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/httpstream"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/apimachinery/pkg/util/proxy"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// PathPrefix is where the front serves members, as Karmada's aggregated
// apiserver does: PathPrefix + "{cluster}/proxy/{path...}".
const PathPrefix = "/apis/cluster.karmada.io/v1alpha1/clusters/"

// Secret is what a member cluster's Secret holds: the CA of its API server,
// and the front's credentials there, a client certificate, a bearer token, or
// both.
type Secret struct {
	CAData   []byte
	CertData []byte
	KeyData  []byte
	Token    string
}

// Cluster is a member cluster as the front knows it.
type Cluster struct {
	Name        string
	APIEndpoint string // https://host:port
	ProxyURL    string // optional HTTP proxy (CONNECT) in front of the member
	// ProxyHeader is sent on every CONNECT to ProxyURL, as Karmada's
	// Spec.ProxyHeader (typically the proxy's credentials).
	ProxyHeader http.Header
	Secret      Secret
}

// Clusters holds the member clusters in memory, as an informer's cache would.
// It is safe for concurrent use.
type Clusters struct {
	mu sync.RWMutex // guards m
	m  map[string]Cluster
}

// NewClusters returns an empty set of clusters.
func NewClusters() *Clusters { return &Clusters{m: map[string]Cluster{}} }

// Set adds a cluster or replaces it (a rotated Secret, a new endpoint).
func (c *Clusters) Set(cl Cluster) {
	c.mu.Lock()
	c.m[cl.Name] = cl
	c.mu.Unlock()
}

// Delete removes a cluster.
func (c *Clusters) Delete(name string) {
	c.mu.Lock()
	delete(c.m, name)
	c.mu.Unlock()
}

// Get returns the named cluster.
func (c *Clusters) Get(name string) (Cluster, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	cl, ok := c.m[name]
	return cl, ok
}

// Mode says how the front gets the round tripper for a member request.
type Mode int

const (
	// TransportFor calls Front.TransportFor on the member's config: a
	// pool's TransportFor, or rest.TransportFor when it is nil (client-go's
	// own cache, which cannot cache a config with a proxy).
	TransportFor Mode = iota
	// NewTransport builds a new *http.Transport for every request, as
	// Karmada's proxy did before PR 5610.
	NewTransport
	// NewTransportNoKeepAlive is NewTransport with keep-alive off, as
	// Karmada's proxy does since PR 5610: one connection and one full TLS
	// handshake per request, closed afterwards.
	NewTransportNoKeepAlive
)

func (m Mode) String() string {
	switch m {
	case TransportFor:
		return "TransportFor"
	case NewTransport:
		return "new transport per request"
	case NewTransportNoKeepAlive:
		return "new transport per request, keep-alive off"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Front proxies PathPrefix + "{cluster}/proxy/{path...}" to the member
// clusters in Clusters. Set its fields before serving.
type Front struct {
	Clusters *Clusters
	// TransportFor gives the round tripper for a member config in mode
	// TransportFor, handed the CONNECT header the config's ProxyHeader
	// wrapper adds (nil: the config has none): a pool's
	// TransportFor; nil means rest.TransportFor. The other modes
	// build their transports themselves.
	TransportFor func(cfg *rest.Config, proxyHeader http.Header) (http.RoundTripper, error)
	Mode         Mode
}

// RestConfig builds the member's config from its Secret, as the front does
// for every request.
func RestConfig(cl Cluster) (*rest.Config, error) {
	cfg := &rest.Config{
		Host: cl.APIEndpoint,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   cl.Secret.CAData,
			CertData: cl.Secret.CertData,
			KeyData:  cl.Secret.KeyData,
		},
		BearerToken: cl.Secret.Token,
	}
	if cl.ProxyURL != "" {
		u, err := url.Parse(cl.ProxyURL)
		if err != nil {
			return nil, fmt.Errorf("proxy URL of cluster %q: %w", cl.Name, err)
		}
		cfg.Proxy = http.ProxyURL(u)
		if len(cl.ProxyHeader) > 0 {
			cfg.WrapTransport = ProxyHeaderWrapper(cfg.WrapTransport, cl.ProxyHeader)
		}
	}
	return cfg, nil
}

// ProxyHeaderWrapper is a WrapTransport of the shape Karmada's config builder
// uses for Spec.ProxyHeader, exported for the library's tests of that shape:
// it clones the *http.Transport it is handed, sets ProxyConnectHeader on the
// clone and hands that to next. Any other round
// tripper goes to next unchanged (the wrapper cannot set a header on it).
func ProxyHeaderWrapper(next transport.WrapperFunc, h http.Header) transport.WrapperFunc {
	return func(rt http.RoundTripper) http.RoundTripper {
		if t, ok := rt.(*http.Transport); ok {
			t = t.Clone()
			t.ProxyConnectHeader = h.Clone()
			rt = t
		}
		if next != nil {
			rt = next(rt)
		}
		return rt
	}
}

func (f *Front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	name, path, ok := splitPath(r.URL.Path)
	if !ok {
		writeStatus(w, http.StatusNotFound, "NotFound", "the server could not find the requested resource")
		return
	}
	cl, ok := f.Clusters.Get(name)
	if !ok {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("clusters.cluster.karmada.io %q not found", name))
		return
	}
	cfg, err := RestConfig(cl)
	if err != nil {
		writeStatus(w, http.StatusInternalServerError, "InternalError", fmt.Sprintf("cluster %q: %v", name, err))
		return
	}
	location, err := url.Parse(cl.APIEndpoint)
	if err != nil {
		writeStatus(w, http.StatusInternalServerError, "InternalError", fmt.Sprintf("API endpoint of cluster %q: %v", name, err))
		return
	}
	location.Path = strings.TrimSuffix(location.Path, "/") + "/" + path
	// The upgrade path writes location itself, query included.
	location.RawQuery = r.URL.RawQuery

	// The member must see the front's credentials only: what the caller sent
	// to authenticate to the front is not forwarded. (client-go's bearer
	// token wrapper would also keep a caller's Authorization header.)
	for h := range r.Header {
		if strings.EqualFold(h, "Authorization") || strings.HasPrefix(strings.ToLower(h), "impersonate-") {
			r.Header.Del(h)
		}
	}

	responder := errorResponder{cluster: name}
	var h *proxy.UpgradeAwareHandler
	if httpstream.IsUpgradeRequest(r) {
		upgrade, err := upgradeTransport(cfg, cl.ProxyHeader)
		if err != nil {
			writeStatus(w, http.StatusInternalServerError, "InternalError", fmt.Sprintf("cluster %q: %v", name, err))
			return
		}
		h = proxy.NewUpgradeAwareHandler(location, nil, false, true, responder)
		h.UpgradeTransport = upgrade
	} else {
		rt, err := f.roundTripper(cfg, cl.ProxyHeader)
		if err != nil {
			writeStatus(w, http.StatusInternalServerError, "InternalError", fmt.Sprintf("cluster %q: %v", name, err))
			return
		}
		h = proxy.NewUpgradeAwareHandler(location, rt, false, false, responder)
	}
	h.UseLocationHost = true
	h.ServeHTTP(w, r)
}

func (f *Front) roundTripper(cfg *rest.Config, proxyHeader http.Header) (http.RoundTripper, error) {
	if f.Mode == TransportFor {
		if f.TransportFor != nil {
			return f.TransportFor(cfg, proxyHeader)
		}
		return rest.TransportFor(cfg)
	}
	tlsConfig, err := rest.TLSConfigFor(cfg)
	if err != nil {
		return nil, err
	}
	t := utilnet.SetTransportDefaults(&http.Transport{
		TLSClientConfig:   tlsConfig,
		Proxy:             cfg.Proxy,
		DisableKeepAlives: f.Mode == NewTransportNoKeepAlive,
	})
	// The config's own wrappers (the proxy header's) come first, then its
	// credentials.
	return rest.HTTPWrappersForConfig(cfg, t)
}

// upgradeTransport is what an upgrade (exec, attach, port-forward) is sent
// with: one dedicated HTTP/1.1 connection, never a pooled one. Without it,
// UpgradeAwareHandler would dial with the dialer and TLS config it digs out
// of the plain round tripper (the shared transport's, with the pool), and
// would write the request without the bearer token that client-go's wrappers
// add. proxyHeader goes on the CONNECT when the config has a proxy.
func upgradeTransport(cfg *rest.Config, proxyHeader http.Header) (proxy.UpgradeRequestRoundTripper, error) {
	tlsConfig, err := rest.TLSConfigFor(cfg)
	if err != nil {
		return nil, err
	}
	if tlsConfig == nil {
		tlsConfig = &tls.Config{}
	}
	// Credentials and user agent, as client-go adds them.
	headers, err := rest.HTTPWrappersForConfig(cfg, proxy.MirrorRequest)
	if err != nil {
		return nil, err
	}
	// UpgradeAwareHandler takes the dialer and TLS config of this transport
	// and does the TLS handshake itself.
	conn := &http.Transport{TLSClientConfig: tlsConfig}
	if cfg.Proxy != nil {
		conn.DialContext = connectDialer(cfg, proxyHeader)
	}
	return proxy.NewUpgradeRequestRoundTripper(conn, headers), nil
}

// connectDialer dials addr through the config's HTTP proxy with CONNECT,
// which apimachinery's upgrade dialing does not do by itself; the CONNECT
// carries header.
func connectDialer(cfg *rest.Config, header http.Header) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h := header.Clone()
		if h == nil {
			h = http.Header{}
		}
		req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Scheme: "https", Host: addr}, Host: addr, Header: h}
		proxyURL, err := cfg.Proxy(req)
		if err != nil {
			return nil, err
		}
		var d net.Dialer
		if proxyURL == nil {
			return d.DialContext(ctx, network, addr)
		}
		conn, err := d.DialContext(ctx, "tcp", proxyURL.Host)
		if err != nil {
			return nil, fmt.Errorf("dial proxy %s: %w", proxyURL.Redacted(), err)
		}
		if deadline, ok := ctx.Deadline(); ok {
			_ = conn.SetDeadline(deadline)
		}
		if err := req.Write(conn); err != nil {
			conn.Close()
			return nil, err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), req)
		if err != nil {
			conn.Close()
			return nil, fmt.Errorf("proxy %s: %w", proxyURL.Redacted(), err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			conn.Close()
			return nil, fmt.Errorf("proxy %s: CONNECT %s: %s", proxyURL.Redacted(), addr, resp.Status)
		}
		_ = conn.SetDeadline(time.Time{})
		return conn, nil
	}
}

// splitPath splits PathPrefix + "{cluster}/proxy/{path...}".
func splitPath(p string) (cluster, rest string, ok bool) {
	after, ok := strings.CutPrefix(p, PathPrefix)
	if !ok {
		return "", "", false
	}
	cluster, rest, ok = strings.Cut(after, "/proxy")
	if !ok || cluster == "" || strings.Contains(cluster, "/") || (rest != "" && rest[0] != '/') {
		return "", "", false
	}
	return cluster, strings.TrimPrefix(rest, "/"), true
}

// errorResponder answers a failed proxy request with a Status naming the
// member, as kube-apiserver's proxy does: 503 when the member cannot be
// reached.
type errorResponder struct{ cluster string }

func (e errorResponder) Error(w http.ResponseWriter, _ *http.Request, err error) {
	writeStatus(w, http.StatusServiceUnavailable, "ServiceUnavailable",
		fmt.Sprintf("cluster %q is unreachable: %v", e.cluster, err))
}

func writeStatus(w http.ResponseWriter, code int, reason, message string) {
	b, _ := json.Marshal(map[string]any{
		"kind": "Status", "apiVersion": "v1", "metadata": map[string]any{},
		"status": "Failure", "message": message, "reason": reason, "code": code,
	})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(b)
}
