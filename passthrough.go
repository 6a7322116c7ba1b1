// Configs the pool leaves to client-go: why, how each is counted and
// logged, and client-go's own transport for a config.

package sharedtransport

import (
	"net/http"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// passReason says why a config passes through to client-go untouched.
type passReason int

const (
	shared             passReason = iota
	ownTransport                  // the caller's own Transport is never replaced
	noTLS                         // client-go uses http.DefaultTransport, already shared
	unnamedDial                   // a custom Dial WithDialIdentity does not name
	undeclaredWrappers            // wrappers the pool cannot read
	proxyFailed                   // a Proxy function that fails
	functionsInWrap               // a Proxy or Dial function: WrapTransport sees no config to tell a copy's from
)

// passedThrough counts a config left to client-go, and logs why where its
// caller can share it after all: once per pool for undeclared wrappers,
// every time for a Proxy function that fails. Wrap logs its own reason.
func (v *env) passedThrough(cfg *rest.Config, pass passReason, proxyErr error) {
	v.stats.passThrough.Add(1)
	log := v.opts.logger.V(2)
	switch pass {
	case proxyFailed:
		log.Info("Config passes through: its Proxy function failed", "host", redactHost(cfg.Host), "err", redactError(proxyErr))
	case undeclaredWrappers:
		v.undeclaredOnce.Do(func() {
			log.Info("Config passes through: its WrapTransport holds wrappers the pool cannot read; "+
				"declare what they do with WithPerRequestWrappers or WithProxyConnectHeader to share its transport (logged once)", "host", redactHost(cfg.Host))
		})
	}
}

// clientGoTransport returns the transport client-go builds, or takes from
// its cache, for tc, as it hands it to WrapTransport. The per-request layers
// (user agent, credentials, impersonation), which its key leaves out, are
// not built.
func clientGoTransport(tc *transport.Config) (http.RoundTripper, error) {
	var base http.RoundTripper
	c := *tc
	c.UserAgent, c.Username, c.Password, c.BearerToken, c.BearerTokenFile = "", "", "", "", ""
	c.Impersonate = transport.ImpersonationConfig{}
	c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		base = rt
		return rt
	}
	if _, err := transport.New(&c); err != nil {
		return nil, err
	}
	return base, nil
}

// withConnectHeader returns what the declared CONNECT-header wrapper
// (WithProxyConnectHeader) makes of client-go's transport rt without the
// pool below it: a clone with header h, when rt is a bare *http.Transport.
func withConnectHeader(rt http.RoundTripper, h http.Header) http.RoundTripper {
	t, ok := rt.(*http.Transport)
	if !ok || len(h) == 0 {
		return rt
	}
	t = t.Clone()
	t.ProxyConnectHeader = h.Clone()
	return t
}
