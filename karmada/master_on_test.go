//go:build karmada_master

package karmada

import (
	"k8s.io/client-go/rest"

	clusterv1alpha1 "github.com/karmada-io/karmada/pkg/apis/cluster/v1alpha1"
	"github.com/karmada-io/karmada/pkg/util"
)

// karmadaRelease names the Karmada this build has, in the tables the
// tests log: karmada/hack/test-master.sh builds master.
const karmadaRelease = "Karmada master"

// rotatingMemberConfig is master's own BuildClusterConfig: it wraps
// client-go's ResettableTokenSourceWrapTransport over a cached source that
// reads the cluster's Secret through sec (PR 7663).
func rotatingMemberConfig(name string, cluster func(string) (*clusterv1alpha1.Cluster, error), sec *rotatingSecret) (*rest.Config, error) {
	return util.BuildClusterConfig(name, cluster, sec.secret)
}
