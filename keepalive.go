// Keep-alive, and keep-alive off with resumption: with WithKeepAlive(false)
// every request opens a connection of its own, closed when its response
// ends, and TLS session resumption keeps those handshakes cheap. A resumed
// session authenticates as the certificate of the handshake it came from,
// so each version of an identity's certificate resumes from a session cache
// of its own.

package sharedtransport

import (
	"crypto/tls"

	"github.com/sharedtransport/sharedtransport/internal/conns"
)

// WithKeepAlive turns HTTP keep-alive on (the default) or off for the pool's
// transports. With it off every request opens its own connection, closed
// when the response ends; TLS session resumption keeps most of those
// handshakes cheap. Transports outside the pool are never touched.
func WithKeepAlive(enabled bool) Option {
	return func(o *options) { o.keepAlive = enabled }
}

// WithSessionResumption turns TLS session resumption on (the default) or
// off. Each version of each identity's certificate has its own session
// cache: a resumed session carries the client certificate it came from.
func WithSessionResumption(enabled bool) Option {
	return func(o *options) { o.sessionResumption = enabled }
}

// sessionCache returns the session cache of a new version of id's
// certificate, or nil when its sessions are not resumed: resumption is off,
// or an exec plugin gives the certificate, which changes without a new
// version.
func (o *options) sessionCache(id *identity) tls.ClientSessionCache {
	if !o.sessionResumption || id.key.getCert != nil {
		return nil
	}
	return tls.NewLRUClientSessionCache(conns.SessionCacheSize)
}
