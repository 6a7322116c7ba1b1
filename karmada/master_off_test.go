//go:build !karmada_master

package karmada

import (
	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"

	clusterv1alpha1 "github.com/karmada-io/karmada/pkg/apis/cluster/v1alpha1"
	"github.com/karmada-io/karmada/pkg/util"
)

// karmadaRelease names the Karmada this build has, in the tables the
// tests log: karmada/hack/test-master.sh builds master.
const karmadaRelease = "Karmada v1.18.2"

// rotatingMemberConfig is a member config whose token is read from sec,
// in the shape PR 7663 gives Karmada's master: v1.18.2's BuildClusterConfig,
// its static token cleared, and client-go's ResettableTokenSourceWrapTransport
// over a cached source that reads the cluster's Secret, put together here.
func rotatingMemberConfig(name string, cluster func(string) (*clusterv1alpha1.Cluster, error), sec *rotatingSecret) (*rest.Config, error) {
	cfg, err := util.BuildClusterConfig(name, cluster, sec.secret)
	if err != nil {
		return nil, err
	}
	cfg.BearerToken = ""
	cfg.Wrap(transport.ResettableTokenSourceWrapTransport(transport.NewCachedTokenSource(sec)))
	return cfg, nil
}
