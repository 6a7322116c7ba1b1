// One version of an identity's TLS material and the transports built for
// it (internal/conns), configured as client-go configures its own.

package sharedtransport

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"sync/atomic"

	"k8s.io/client-go/transport"

	"github.com/sharedtransport/sharedtransport/internal/conns"
)

// generation is one version of an identity's TLS material and its
// transports. A rotation builds the next and retires this one.
type generation struct {
	material *material
	// ca is the digest of material.caPEM: a client of Wrap rides the
	// generation only while it trusts what the generation trusts
	// (clientTransport.pick).
	ca     digest
	warned atomic.Bool // the expiry warning for its certificate was logged
	conns  *conns.Transports
}

// certificate is the client certificate the generation authenticates with,
// nil without one (or with an exec plugin's, which the plugin keeps).
func (g *generation) certificate() *x509.Certificate {
	if g.material.cert == nil {
		return nil
	}
	return g.material.cert.Leaf
}

// newGeneration builds e's transports for material m as client-go's
// tlsTransportCache builds its own (transport.TLSConfigFor), with the pool's
// options. prev is the generation they take over from; nil for the first.
func (p *Pool) newGeneration(e *entry, m *material, prev *generation) (*generation, error) {
	id := e.id
	if len(m.certPEM) > 0 && m.cert == nil {
		return nil, errors.New("sharedtransport: internal error: a client certificate was not checked before use")
	}
	getCert := id.key.getCert
	if m.cert != nil {
		// The pair checkMaterial parsed, handed to client-go as a callback
		// rather than as bytes to parse again. Inline data takes precedence
		// over an exec plugin's callback in client-go; here too.
		getCert = &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return m.cert, nil }}
	}
	tlsConfig, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{
		Insecure:      id.key.insecure,
		ServerName:    id.key.serverName,
		NextProtos:    id.nextProtos,
		CAData:        m.caPEM,
		GetCertHolder: getCert,
	}})
	if err != nil {
		return nil, err
	}
	if id.tlsConfig != nil {
		tlsConfig = id.tlsConfig // TLSTransport: the caller's own, which holds no material
	}
	g := &generation{material: m, ca: digestOf(m.caPEM)}
	var older *conns.Transports
	if prev != nil {
		older = prev.conns
	}
	g.conns = conns.NewTransports(conns.Config{
		TLS:                tlsConfig,
		Dial:               id.dial,
		Proxy:              id.proxy,
		ProxyConnectHeader: id.connectHeader,
		DisableCompression: id.key.disableCompression,
		DisableHTTP2:       id.key.noHTTP2,
		KeepAlive:          p.opts.keepAlive,
		// An exec plugin's certificate can change without a new generation,
		// and a resumed session would go on authenticating as the old one.
		ResumeSessions:  p.opts.sessionResumption && id.key.getCert == nil,
		MaxConnsPerHost: p.opts.maxConnsPerHost,
		Counters:        []*conns.Counters{&p.stats.conn, &e.stats.conn},
	}, older)
	return g, nil
}
