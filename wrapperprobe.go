// The probe that finds out, at Wrap, what the wrappers already in a config's
// WrapTransport do to the transport below them: it runs them over an
// in-memory transport, sends one request through what they return and reads
// what reaches the wire.

package sharedtransport

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/third_party/forked/golang/netutil"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
	certutil "k8s.io/client-go/util/cert"
)

// connectHeaderFor returns the headers cfg's CONNECT requests carry because
// of a wrapper already in cfg.WrapTransport. Such a wrapper (Karmada's
// Spec.ProxyHeader type-asserts the round tripper below it to
// *http.Transport, in its own RoundTrip, and sends the request over a clone
// with ProxyConnectHeader set) sits above the hook and is handed the pool's
// round tripper, so it would do nothing: the pool finds out what it does by
// sending one request through cfg.WrapTransport over a probe transport, to
// a host that does not exist (a wrapper that ignores the transport it is
// handed reaches no server). share is false when the request reached the
// wire in any other way than the probe sends it, or did not reach it: the
// pool cannot give that to shared connections, and dropping it silently
// would change what the config does.
func (p *Pool) connectHeaderFor(cfg *rest.Config) (h http.Header, share bool) {
	if cfg.WrapTransport == nil {
		return nil, true
	}
	h, ok := probeWrappers(cfg.WrapTransport, probeTarget)
	if !ok {
		p.opts.logger.V(2).Info("Config passes through: a wrapper in its WrapTransport changes what its requests put on the wire beyond CONNECT headers", "host", redactHost(cfg.Host))
		return nil, false
	}
	return h, true
}

// probeTarget is the server the probe's request is for; nothing answers
// there but the probe itself.
var probeTarget = &url.URL{Scheme: "https", Host: "probe.sharedtransport.invalid:443", Path: "/"}

// isProbe reports whether rt is a probe transport of a probe running now:
// the hook of a config wrapped again is run over it, and hands it on.
func isProbe(rt http.RoundTripper) bool {
	t, ok := rt.(*http.Transport)
	if !ok {
		return false
	}
	_, ok = liveProbes.Load(t)
	return ok
}

// liveProbes holds the probe transports of the probes running now, by
// pointer.
var liveProbes sync.Map

// probeTimeout bounds one probe: every step is in memory, so only a wrapper
// that holds the request runs into it.
const probeTimeout = 5 * time.Second

// probeWrappers sends one request for target through wrap over a probe
// transport and returns the CONNECT headers the wrappers added to it. ok is
// false unless the wire saw what it sees without wrappers, but for those
// headers: one dial, to the probe's proxy, a tunnel to target, the probe's
// TLS hello, no client certificate, the server verified against the probe's
// roots, the request served with the probe's Accept-Encoding.
func probeWrappers(wrap transport.WrapperFunc, target *url.URL) (h http.Header, ok bool) {
	base, err := baseline()
	if err != nil {
		return nil, false
	}
	got, err := runProbe(wrap, target)
	if err != nil || !got.sameWire(base) {
		return nil, false
	}
	return got.addedHeader(base), true
}

// baseline is what the probe sees of a request sent over the probe
// transport itself; a failed run is tried again at the next probe.
func baseline() (*wire, error) {
	baselineMu.Lock()
	defer baselineMu.Unlock()
	if baselineWire == nil {
		w, err := runProbe(func(rt http.RoundTripper) http.RoundTripper { return rt }, probeTarget)
		if err != nil {
			return nil, err
		}
		baselineWire = w
	}
	return baselineWire, nil
}

var (
	baselineMu   sync.Mutex // guards baselineWire
	baselineWire *wire
)

// wire is what reached the probe's in-memory proxy and server.
type wire struct {
	mu          sync.Mutex
	dials       int
	dialAddr    string
	connectHost string
	header      http.Header // the CONNECT request's
	sni         string
	alpn        []string
	versions    []uint16
	ciphers     []uint16 // the hello's cipher suites: what CipherSuites decides
	curves      []tls.CurveID
	peerCerts   int
	verified    bool   // the client verified the server against the probe's roots
	served      bool   // the request arrived through the tunnel
	encoding    string // its Accept-Encoding: what DisableCompression decides
	target      string
}

func (w *wire) sameWire(base *wire) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dials == base.dials && w.dialAddr == base.dialAddr && w.connectHost == w.target &&
		w.sni == base.sni && slices.Equal(w.alpn, base.alpn) && slices.Equal(w.versions, base.versions) &&
		slices.Equal(w.ciphers, base.ciphers) && slices.Equal(w.curves, base.curves) &&
		w.peerCerts == 0 && w.verified && w.served && w.encoding == base.encoding
}

// addedHeader returns the CONNECT header fields w carries that base does
// not carry with the same values.
func (w *wire) addedHeader(base *wire) http.Header {
	var h http.Header
	for k, v := range w.header {
		if slices.Equal(base.header[k], v) {
			continue
		}
		if h == nil {
			h = http.Header{}
		}
		h[k] = slices.Clone(v)
	}
	return h
}

// runProbe runs wrap over a new probe transport and sends one GET for
// target through the result. Everything the probe starts has ended when it
// returns.
func runProbe(wrap transport.WrapperFunc, target *url.URL) (*wire, error) {
	id, err := probeIdentity()
	if err != nil {
		return nil, err
	}
	w := &wire{target: netutil.CanonicalAddr(target)}
	var served sync.WaitGroup
	probe := newProbeTransport(id, w, &served)
	liveProbes.Store(probe, struct{}{})
	defer liveProbes.Delete(probe)
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	sent := make(chan error, 1)
	go func() { sent <- sendProbe(ctx, wrap, probe, target) }()
	select {
	case err = <-sent:
	case <-ctx.Done():
		// A wrapper that holds the request past the context: Wrap does not
		// wait for it, and the config passes through.
		return nil, errors.New("sharedtransport: a wrapper held the probe request past its deadline")
	}
	cancel()
	probe.CloseIdleConnections()
	served.Wait()
	if err != nil {
		return nil, err
	}
	return w, nil
}

// sendProbe sends the probe request through what wrap makes of probe. A
// wrapper written for client-go's transports may not expect a probe: a
// panic is an error, and what it does to theirs is then unknown.
func sendProbe(ctx context.Context, wrap transport.WrapperFunc, probe *http.Transport, target *url.URL) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = errors.New("sharedtransport: a wrapper panicked on the probe transport")
		}
	}()
	rt := wrap(probe)
	if t, ok := rt.(*http.Transport); ok && t.GetProxyConnectHeader != nil || probe.GetProxyConnectHeader != nil {
		// Headers chosen per proxy and target: the probe sees them for its
		// own proxy only.
		return errors.New("sharedtransport: a wrapper sets GetProxyConnectHeader")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target.String(), nil)
	if err != nil {
		return err
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return err
	}
	return resp.Body.Close()
}

// probeProxyAddr is where the probe transport's proxy is; nothing listens
// there: the probe's dialer answers in memory.
const probeProxyAddr = "proxy.sharedtransport.invalid:3128"

// newProbeTransport returns a transport whose proxy and server are in
// memory and record what reaches them in w. Keep-alive is off, so that the
// clones a wrapper makes of it keep no connection.
func newProbeTransport(id *probeTLS, w *wire, served *sync.WaitGroup) *http.Transport {
	return &http.Transport{
		Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: probeProxyAddr}),
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			client, server := net.Pipe()
			w.mu.Lock()
			w.dials++
			w.dialAddr = addr
			w.mu.Unlock()
			deadline, _ := ctx.Deadline()
			server.SetDeadline(deadline)
			served.Add(1)
			go func() {
				defer served.Done()
				defer server.Close()
				serveProbe(server, id, w)
			}()
			return client, nil
		},
		TLSClientConfig: &tls.Config{
			RootCAs:    id.roots,
			ServerName: probeServerName,
			VerifyConnection: func(cs tls.ConnectionState) error {
				w.mu.Lock()
				w.verified = len(cs.VerifiedChains) > 0
				w.mu.Unlock()
				return nil
			},
		},
		DisableKeepAlives: true,
	}
}

// serveProbe is the probe's proxy and server on one connection: it answers
// the CONNECT, then the TLS handshake and the request through the tunnel.
func serveProbe(conn net.Conn, id *probeTLS, w *wire) {
	br := bufio.NewReader(conn)
	connect, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	w.mu.Lock()
	if connect.Method == http.MethodConnect {
		w.connectHost, w.header = connect.Host, connect.Header
	}
	w.mu.Unlock()
	if connect.Method != http.MethodConnect {
		conn.Write([]byte("HTTP/1.1 405 Method Not Allowed\r\nConnection: close\r\n\r\n"))
		return
	}
	if _, err := conn.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		return
	}
	tc := tls.Server(&bufferedConn{Conn: conn, r: br}, id.serverConfig(w))
	if err := tc.Handshake(); err != nil {
		return
	}
	w.mu.Lock()
	w.peerCerts = len(tc.ConnectionState().PeerCertificates)
	w.mu.Unlock()
	req, err := http.ReadRequest(bufio.NewReader(tc))
	if err != nil {
		return
	}
	w.mu.Lock()
	w.served, w.encoding = true, req.Header.Get("Accept-Encoding")
	w.mu.Unlock()
	// The pipe closes on return, without a close_notify: a write on a pipe
	// waits for the peer to read, and the client is done reading.
	tc.Write([]byte("HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"))
}

// bufferedConn reads what a bufio.Reader already took off the connection
// first.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(b []byte) (int, error) { return c.r.Read(b) }

const probeServerName = "server.sharedtransport.invalid"

// probeTLS is the probe server's certificate and the roots that trust it.
type probeTLS struct {
	cert  tls.Certificate
	roots *x509.CertPool
}

func (id *probeTLS) serverConfig(w *wire) *tls.Config {
	return &tls.Config{
		Certificates: []tls.Certificate{id.cert},
		ClientAuth:   tls.RequestClientCert,
		// No tickets: the server would write them while the client writes
		// its request, and a pipe has no buffer to hold either.
		SessionTicketsDisabled: true,
		GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			w.mu.Lock()
			w.sni = hello.ServerName
			w.alpn = slices.Clone(hello.SupportedProtos)
			w.versions = slices.Clone(hello.SupportedVersions)
			w.ciphers = slices.Clone(hello.CipherSuites)
			w.curves = slices.Clone(hello.SupportedCurves)
			w.mu.Unlock()
			return nil, nil
		},
	}
}

// probeIdentity is the probe server's certificate, made once per process
// with client-go's own self-signed helper, and roots that trust it.
var probeIdentity = sync.OnceValues(func() (*probeTLS, error) {
	certPEM, keyPEM, err := certutil.GenerateSelfSignedCertKey(probeServerName, nil, nil)
	if err != nil {
		return nil, err
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(certPEM)
	return &probeTLS{cert: cert, roots: roots}, nil
})
