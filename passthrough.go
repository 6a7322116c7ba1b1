// Configs the pool leaves to client-go: why, and how each is counted and
// logged.

package sharedtransport

import "k8s.io/client-go/rest"

// passReason says why a config passes through to client-go untouched.
type passReason int

const (
	shares             passReason = iota
	ownTransport                  // the caller's own Transport is never replaced
	noTLS                         // client-go uses http.DefaultTransport, already shared
	unnamedDial                   // a custom Dial WithDialIdentity does not name
	undeclaredWrappers            // wrappers the pool cannot read
	proxyFailed                   // a Proxy function that fails
	functionsInWrap               // Wrap cannot tell a Proxy or Dial function from a copy's
)

// passedThrough counts a config left to client-go, and logs why where its
// caller can share it after all: once per pool for what is the caller's
// choice, every time for a Proxy function that fails.
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
	case functionsInWrap:
		v.functionsOnce.Do(func() {
			log.Info("Config passes through Wrap: it has a Proxy or Dial function, which the hook cannot tell from a copy's; "+
				"build its clients with HTTPClientFor or TransportFor to share its transport (logged once)", "host", redactHost(cfg.Host))
		})
	}
}
