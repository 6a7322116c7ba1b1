//go:build !karmada_patched

package karmada

import "github.com/sharedtransport/sharedtransport"

// patched: this build has Karmada v1.18.2 as is.
const patched = false

// clusterTransports is for the patched build only: Karmada as is has no
// pool to set.
func clusterTransports(*sharedtransport.Pool) func() {
	panic("clusterTransports: Karmada as is has no ClusterTransports")
}
