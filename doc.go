// Package sharedtransport makes client-go clients with the same TLS identity
// share one HTTP transport, and so one connection pool, whatever rest.Config
// they were built from.
//
// client-go shares a transport between configs only when its own cache can
// key them. A config with a Proxy function, a custom Dial, or built afresh for
// every request (an aggregated apiserver proxying to member clusters, a CLI
// in a loop) gets a new transport each time, and every new transport opens
// new TCP and TLS connections: under load, thousands to one server. Different
// client certificates need different connections; configs of one identity
// never do.
//
// One call installs the library on an existing config:
//
//	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
//	...
//	if err := sharedtransport.Wrap(cfg); err != nil { ... }
//	clientset, err := kubernetes.NewForConfig(cfg)
//
// [Wrap] and [BuildConfigFromFlags] use a package-level default [Pool]. Create
// a Pool with [New] for options, for [Pool.Stats], or to [Pool.Close] it.
// [Pool.WrapConfigFn] has the shape of cli-runtime's ConfigFlags.WrapConfigFn,
// and [Pool.WrapClientConfig] wraps a clientcmd.ClientConfig.
//
// # A config per request
//
// Code that builds a config per request or per reconcile and asks for a
// round tripper or a client itself (an aggregated apiserver's proxy, a
// multi-cluster controller) calls [Pool.TransportFor] or [Pool.HTTPClientFor]
// ([TransportFor] and [HTTPClientFor] on the default pool) in place of
// rest.TransportFor and rest.HTTPClientFor, and passes the client to
// kubernetes.NewForConfigAndClient. The identity is computed from the config,
// so client-go builds no transport for it; client-go's own functions put the
// per-request layers (credentials, impersonation, user agent, exec and auth
// providers, WrapTransport) above the shared transport.
//
// # Identity
//
// Two configs share a transport when they agree on everything that changes
// what a connection is or whom it authenticates as: CA, client certificate and
// key (their bytes, or their paths when they are files, which are then
// watched), the exec plugin's certificate, insecure, server name, next
// protocols, compression, proxy and dialer. Bearer tokens, basic auth,
// impersonation, user agent and host are not identity: client-go adds them to
// each request above the transport. A Proxy function is asked where it sends
// the config's host; a custom Dial is shared only when [WithDialIdentity] names
// it.
//
// # Copies of a wrapped config
//
// rest.CopyConfig copies the hook, so it also runs for copies of a wrapped
// config and for the config changed in place, whatever changed. A client
// rides the shared transport only when client-go's own transport for that
// client is shown to present the same client certificate, trust the same
// roots, dial, route, negotiate and compress exactly as the shared one;
// anything not shown keeps client-go's transport. A finding holds for one
// version of the identity's material: after a rotation each client checks
// again, and material the pool used before never makes a match.
//
// A wrapper added to a copy after Wrap runs above the hook and is handed the
// pool's round tripper: one that type-asserts *http.Transport to change it
// (a certificate, a proxy header) finds none and changes nothing. Add such
// wrappers before Wrap, where the hook compares what they built.
//
// An identity no client refers to any more is released, connections and
// memory, after [WithIdleTimeout].
//
// # Keep-alive
//
// [WithKeepAlive](false) gives every request its own connection, on this
// pool's transports only. TLS session resumption, one session cache per
// identity and per certificate version, keeps those handshakes cheap
// ([WithSessionResumption]). A burst of first requests to a host waits for the
// first connection instead of dialing one each.
//
// # Certificate rotation
//
// When a config names certificate, key or CA files, the pool watches their
// directories (kubelet's "..data" symlink swap, rename-over, rewrite in place,
// delete and create again) and polls as a fallback ([WithPollInterval]).
// Events for other files in those directories are ignored, and a reload
// starts at most half a second after the first event however busy the files
// are. A valid change is used by the next handshake at once; idle connections
// close; active ones (watches) are closed after [WithDrainTimeout]. Torn,
// empty or mismatched files, anything but a regular file, and a certificate
// outside its validity window (a NotBefore up to 5 minutes ahead is allowed
// for clock skew) are rejected and the last good material kept, so a failed
// reload never fails a request. A CA bundle may hold text around its PEM
// blocks, as client-go allows.
//
// # Limits of the platform
//
// On Linux a pool uses one inotify instance, and one inotify watch per
// watched directory. The kernel limits both per user, across all of that
// user's processes (fs.inotify.max_user_instances and
// fs.inotify.max_user_watches). When it refuses one, [Pool.Wrap] still works:
// the directories concerned are polled every 10 seconds, the refusal is logged
// once and counted in [Stats].UnwatchedDirs, and file events are taken again
// once the kernel allows them. On macOS and the BSDs, fsnotify's kqueue keeps
// a file descriptor open for every watched directory and for every file in
// it, against the process's open-file limit; a refusal there is handled the
// same way. Events the kernel drops (its queue overflowed) make the pool read
// every watched file again. Network file systems report no events for changes
// made by other machines; the poll finds those. A read of a hung mount is
// abandoned after 5 seconds, holds up no other identity, and does not delay
// [Pool.Close].
package sharedtransport
