// What a caller declares with a config, per call of Wrap, TransportFor or
// HTTPClientFor: what the wrappers already on the config do to its
// connections, which the pool cannot read from them.

package sharedtransport

import "net/http"

// A CallOption declares, for one call of [Pool.Wrap], [Pool.TransportFor]
// or [Pool.HTTPClientFor], what the wrappers already in the config's
// WrapTransport do to its connections.
//
// The pool cannot read a wrapper's code, so a config that has wrappers when
// it is given passes through to client-go's own transport unless they are
// declared. Declared, they sit above the pool's round tripper and must send
// every request through the round tripper they are handed (a wrapper that
// clones an [http.Transport] it finds there, and otherwise passes the
// request on, does).
type CallOption func(*declaration)

// WithPerRequestWrappers declares that the wrappers already on the config
// act on requests only (headers, credentials, logging, metrics) and leave
// the connection alone.
func WithPerRequestWrappers() CallOption {
	return func(g *declaration) { g.declared = true }
}

// WithProxyConnectHeader declares that the wrappers already on the config
// add h to the CONNECT requests sent to the config's proxy, as a wrapper
// that sets a cluster's proxy header on a cloned transport does, and
// otherwise act on requests only. The pool sets h on the shared
// transport's CONNECT requests itself. The header is part of the identity:
// configs declaring other headers never share a connection.
func WithProxyConnectHeader(h http.Header) CallOption {
	h = h.Clone()
	return func(g *declaration) { g.declared, g.connectHeader = true, h }
}

// declaration is what a caller declared with a config.
type declaration struct {
	declared      bool
	connectHeader http.Header // added to CONNECT requests by the declared wrappers
}

func declarationOf(opts []CallOption) declaration {
	var g declaration
	for _, opt := range opts {
		opt(&g)
	}
	return g
}
