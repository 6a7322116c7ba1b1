// Package sharedtransport makes client-go clients of one TLS identity share
// one HTTP transport, and so one connection pool, whatever [rest.Config] they
// were built from.
//
// client-go shares a transport between configs only when its own cache can
// key them. A config with a Proxy function or a custom Dial never hits that
// cache, and code that builds a config per request (an aggregated apiserver
// proxying to member clusters, a multi-cluster controller, a CLI in a loop)
// gets a new transport, with new TCP and TLS connections, every time: under
// load, thousands to one server, or, with keep-alive off, a full TLS handshake
// per request. Different client certificates need different connections;
// configs of one identity never do.
//
// # Entry points
//
// Code that hands its config to client-go (clientsets, informers, clientcmd)
// calls [Wrap] on it, or [BuildConfigFromFlags]:
//
//	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
//	if err != nil { ... }
//	if err := sharedtransport.Wrap(cfg); err != nil { ... }
//	clientset, err := kubernetes.NewForConfig(cfg)
//
// Code that builds a config per request or per reconcile and asks for a
// client or a round tripper itself calls [Pool.HTTPClientFor] or
// [Pool.TransportFor] in place of [rest.HTTPClientFor] and
// [rest.TransportFor]; client-go then builds no transport of its own:
//
//	hc, err := pool.HTTPClientFor(cfg)
//	if err != nil { ... }
//	clientset, err := kubernetes.NewForConfigAndClient(cfg, hc)
//
// Code that builds its own [http.Transport] from a [tls.Config] and never a
// rest.Config (a cluster proxy) calls [Pool.TLSTransport] with the settings
// it would have put on that transport:
//
//	rt, err := pool.TLSTransport(sharedtransport.TLSTransportConfig{TLS: tlsConfig, Proxy: proxyURL})
//
// CLIs built on cli-runtime set [Pool.WrapConfigFn] as
// genericclioptions.ConfigFlags.WrapConfigFn; [Pool.WrapClientConfig] wraps a
// clientcmd.ClientConfig. [Wrap], [BuildConfigFromFlags], [TransportFor],
// [HTTPClientFor] and [TLSTransport] use a package-level default [Pool];
// create one with [New] for options, for [Pool.Stats] and [Pool.Identities],
// or to [Pool.Close] it.
//
// # Identity
//
// Two configs share a transport exactly when they agree on everything that
// changes what a connection is or whom it authenticates as: the CA and the
// client certificate and key (their bytes, or their paths when they are
// files, which are then watched), the exec plugin's certificate, insecure,
// server name, next protocols, compression, the proxy the config's Proxy
// function gives for its host and that proxy's CONNECT headers, and a custom
// dialer named by [WithDialIdentity]. Bearer tokens, basic auth,
// impersonation, user agent and host are not identity: client-go adds them
// to each request above the transport, so configs that differ only there
// share connections safely.
//
// # Copies of a wrapped config
//
// [rest.CopyConfig] copies the hook Wrap installs, so it also runs for copies
// of a wrapped config and for the config changed in place. A client rides
// the shared transport only when the pool can show, through what Go's and
// client-go's public APIs promise, that client-go's own transport for that
// client would authenticate, trust, dial, route, negotiate and compress as
// the shared one does; otherwise it keeps client-go's transport, and
// [Stats].PassThrough counts it. For a config client-go caches (no Proxy, no
// Dial), client-go's cache key decides: a client shares when client-go hands
// the hook the transport its cache holds for the wrapped config. For a config
// client-go does not cache, Wrap puts a dialer of the pool's in the config's
// Dial that dials as the config would; a client whose transport dials through
// it has its TLS settings compared by their public fields, its proxy asked
// per request, and its client certificate asked for at its first request,
// after each rotation and at least every 5 minutes. TransportFor,
// HTTPClientFor and TLSTransport compute the identity from what they are
// given.
//
// So through Wrap these copies keep client-go's transport, where
// HTTPClientFor shares them: a copy naming other files with the same bytes,
// or inline data of the same bytes as the files; a copy that adds a Proxy;
// a copy whose client-go cache key differs in any field. A config with a
// custom Dial is shared only with WithDialIdentity. Wrappers already on a
// config are shared only when declared ([Pool.WrapDeclared]). A wrapper
// added after Wrap runs above the hook: one that unwraps the round tripper
// it is handed gets client-go's transport for the client, which carries the
// client's requests from then on; one that type-asserts [http.Transport]
// without unwrapping finds none. SPDY and websocket round trippers (exec,
// attach, port-forward) and a config's own Transport pass through.
//
// An identity no client refers to any more is released, connections and
// memory, after [WithIdleTimeout].
//
// # Keep-alive
//
// [WithKeepAlive](false) gives every request its own connection, on this
// pool's transports only, never on client-go's. TLS session resumption, one
// session cache per identity and per certificate version, turns most of those
// handshakes into resumptions ([WithSessionResumption]). Whatever the
// setting, a burst of first requests to a host waits for its first
// connection instead of dialing one each, and [WithMaxConnsPerHost] caps the
// connections of an identity to a host.
//
// # Certificate rotation
//
// When a config names certificate, key or CA files, the pool watches their
// directories (kubelet's "..data" symlink swap, rename-over, rewrite in
// place, delete and create again) and polls as a fallback
// ([WithPollInterval]). A valid change is used by the next handshake; idle
// connections close at once, busy ones when their requests end, and running
// watches after [WithDrainTimeout], so informers re-list once, later. Torn,
// empty or mismatched files and certificates outside their validity window
// are rejected: clients and connections already using the last good
// material keep it, so a failed reload never fails their requests.
//
// A config built now (Wrap, TransportFor, HTTPClientFor, the clientcmd
// adapters, a client re-taking a released identity) gets what is on disk
// now, within one debounce (100 ms) plus one read: files last read longer
// ago are read again first, and files that are gone, empty, expired or torn
// fail the config with an error naming the file. Files still rejected after
// the debounce are shown in [IdentityInfo].FilesError and fail every new
// config of the identity until they are good again.
//
// # Limits of the platform
//
// On Linux a pool uses one inotify instance, and one inotify watch per
// watched directory; the kernel limits both per user, across all of that
// user's processes (fs.inotify.max_user_instances and max_user_watches).
// When it refuses one, Wrap still works: the directories concerned are
// polled every 10 seconds, the refusal is logged once and counted in
// [Stats].UnwatchedDirs, and file events are taken again once the kernel
// allows them. On macOS and the BSDs, fsnotify's kqueue keeps a file
// descriptor open for every watched directory and every file in it, against
// the process's open-file limit, and a refusal is handled the same way.
// Network file systems report no events for changes made by other machines;
// the poll finds those. A read of a hung mount is abandoned after 5 seconds,
// holds up no other identity, and does not delay [Pool.Close].
package sharedtransport
