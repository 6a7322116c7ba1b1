// What a wrapper above the hook finds when it unwraps a client's round
// tripper to reach client-go's transport: a copy of that transport whose
// callbacks are the pool's, so that a change made to it in place is seen and
// the client's requests then go as they would go without the pool.

package sharedtransport

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/http"
	"net/url"
	"slices"
)

// transportView is a copy of client-go's transport for one client. Its
// proxy, dialer and certificate callbacks delegate to client-go's, and answer
// questions only the pool asks (a request, a context and a certificate
// request of the view's own) with answers only the view holds. While they
// answer so and no other field changed, the view does what client-go's
// transport does. Changed, it is what client-go's transport would have
// become, and the client's requests go through it.
type transportView struct {
	t *http.Transport

	// What the view's TLS configuration was made with.
	tls                    *tls.Config
	roots                  *x509.CertPool
	serverName             string
	insecure               bool
	minVersion, maxVersion uint16
	nextProtos             []string
	hasCert                bool // a certificate callback
	noCompression          bool // the transport's DisableCompression

	proxyQuestion *http.Request
	proxyAnswer   *url.URL
	dialQuestion  context.Context
	certQuestion  *tls.CertificateRequestInfo
	certAnswer    *tls.Certificate
}

type viewKey struct{}

var errViewAnswer = errors.New("sharedtransport: the pool's view answers the pool's question")

func newTransportView(orig *http.Transport) *transportView {
	v := &transportView{
		t:             orig.Clone(),
		proxyAnswer:   &url.URL{},
		certQuestion:  &tls.CertificateRequestInfo{},
		certAnswer:    &tls.Certificate{},
		proxyQuestion: &http.Request{URL: &url.URL{}, Header: http.Header{}},
	}
	v.noCompression = v.t.DisableCompression
	v.dialQuestion = context.WithValue(context.Background(), viewKey{}, v)
	proxy, dial := orig.Proxy, orig.DialContext
	v.t.Proxy = func(req *http.Request) (*url.URL, error) {
		switch {
		case req == v.proxyQuestion:
			return v.proxyAnswer, nil
		case proxy == nil:
			return nil, nil
		}
		return proxy(req)
	}
	v.t.DialContext = func(ctx context.Context, network, address string) (net.Conn, error) {
		switch {
		case ctx == v.dialQuestion:
			return nil, errViewAnswer
		case dial == nil:
			var d net.Dialer
			return d.DialContext(ctx, network, address)
		}
		return dial(ctx, network, address)
	}
	if c := v.t.TLSClientConfig; c != nil {
		v.tls, v.roots, v.serverName, v.insecure = c, c.RootCAs, c.ServerName, c.InsecureSkipVerify
		v.minVersion, v.maxVersion, v.nextProtos = c.MinVersion, c.MaxVersion, slices.Clone(c.NextProtos)
		if cert := c.GetClientCertificate; cert != nil {
			v.hasCert = true
			c.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
				if cri == v.certQuestion {
					return v.certAnswer, nil
				}
				return cert(cri)
			}
		}
	}
	return v
}

// intact reports whether the view is as it was made: nothing changed it.
func (v *transportView) intact() bool {
	t := v.t
	if t.TLSClientConfig != v.tls || t.Dial != nil || t.DialTLS != nil || t.DialTLSContext != nil ||
		t.GetProxyConnectHeader != nil || t.OnProxyConnectResponse != nil || t.ProxyConnectHeader != nil ||
		t.Proxy == nil || t.DialContext == nil || t.DisableCompression != v.noCompression {
		return false
	}
	if u, err := t.Proxy(v.proxyQuestion); err != nil || u != v.proxyAnswer {
		return false
	}
	if _, err := t.DialContext(v.dialQuestion, "", ""); err != errViewAnswer {
		return false
	}
	c := v.tls
	if c == nil {
		return true
	}
	if !onlyClientGoFields(c) || c.RootCAs != v.roots || c.ServerName != v.serverName ||
		c.InsecureSkipVerify != v.insecure || c.MinVersion != v.minVersion || c.MaxVersion != v.maxVersion ||
		!slices.Equal(c.NextProtos, v.nextProtos) {
		return false
	}
	if c.GetClientCertificate == nil || !v.hasCert {
		return c.GetClientCertificate == nil && !v.hasCert
	}
	cert, err := c.GetClientCertificate(v.certQuestion)
	return err == nil && cert == v.certAnswer
}
