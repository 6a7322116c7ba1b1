//go:build karmada_patched

package karmada

import (
	"github.com/karmada-io/karmada/pkg/util/proxy"

	"github.com/sharedtransport/sharedtransport"
)

// patched: this build has Karmada from its source with karmada/patches
// applied (karmada/hack/test-patched.sh).
const patched = true

// clusterTransports makes p the pool the patched cluster proxy takes its
// transports from, and returns what puts the process's own back and closes p.
func clusterTransports(p *sharedtransport.Pool) (restore func()) {
	old := proxy.ClusterTransports
	proxy.ClusterTransports = p
	return func() {
		proxy.ClusterTransports = old
		p.Close()
	}
}
