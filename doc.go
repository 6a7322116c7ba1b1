// Package sharedtransport makes client-go clients of one TLS identity share
// one HTTP transport, and so one connection pool, whatever [rest.Config] they
// were built from.
//
// client-go shares a transport between configs only when its own cache can
// key them. A config with a Proxy function or a custom Dial never hits that
// cache, and code that builds a config per request gets new TCP and TLS
// connections every time. Different client certificates need different
// connections; configs of one identity never do.
//
// Code that hands a config without Proxy or Dial to client-go calls [Wrap]:
//
//	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
//	if err != nil { ... }
//	if err := sharedtransport.Wrap(cfg); err != nil { ... }
//	clientset, err := kubernetes.NewForConfig(cfg)
//
// Code that builds a config per request, or one with Proxy or Dial (which
// Wrap passes through untouched), asks the pool for the client, and
// client-go builds no transport of its own:
//
//	hc, err := pool.HTTPClientFor(cfg)
//	if err != nil { ... }
//	clientset, err := kubernetes.NewForConfigAndClient(cfg, hc)
//
// A cluster proxy that builds its own [http.Transport] from a [tls.Config]
// calls [Pool.TLSTransport]; CLIs on cli-runtime set [Pool.WrapConfigFn].
//
// The pool decides only from what it is given: the config or settings
// passed to it, and the transport client-go's own cache holds for a wrapped
// config. Whatever it cannot decide passes through to client-go's own
// transport, counted in [Stats].PassThrough. Certificate, key and CA files
// are watched and reloaded; a bad reload never fails a request that the
// last good files would serve. [WithKeepAlive](false) gives every request a
// connection of its own, with TLS session resumption.
//
// The README says what identity is, how rotation behaves, what passes
// through and what is measured; docs/design.md how it is built.
package sharedtransport
