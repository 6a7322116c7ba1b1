// The clientcmd adapters: Wrap for code that gets its configs from
// clientcmd or from cli-runtime's flags.

package sharedtransport

import (
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// BuildConfigFromFlags is [clientcmd.BuildConfigFromFlags] followed by
// [Wrap] on the package's default pool.
func BuildConfigFromFlags(masterURL, kubeconfigPath string) (*rest.Config, error) {
	return defaultPool().BuildConfigFromFlags(masterURL, kubeconfigPath)
}

// BuildConfigFromFlags is [clientcmd.BuildConfigFromFlags] followed by
// [Pool.Wrap].
func (p *Pool) BuildConfigFromFlags(masterURL, kubeconfigPath string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags(masterURL, kubeconfigPath)
	if err != nil {
		return nil, err
	}
	if err := p.Wrap(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}

// WrapConfigFn wraps cfg and returns it, in the shape of cli-runtime's
// genericclioptions.ConfigFlags.WrapConfigFn. On error it logs, counts
// [Stats].WrapErrors and returns cfg unchanged, so a CLI keeps working with
// client-go's own transport.
func (p *Pool) WrapConfigFn(cfg *rest.Config) *rest.Config {
	if err := p.Wrap(cfg); err != nil {
		p.stats.wrapErrors.Add(1)
		p.opts.logger.Error(err, "Config left unwrapped; it uses client-go's own transport")
	}
	return cfg
}

// WrapClientConfig returns a clientcmd.ClientConfig whose ClientConfig method
// returns configs wrapped by p: the drop-in for code built on
// clientcmd.NewNonInteractiveDeferredLoadingClientConfig and friends.
func (p *Pool) WrapClientConfig(cc clientcmd.ClientConfig) clientcmd.ClientConfig {
	return &clientConfig{inner: cc, pool: p}
}

// inner names the embedded clientcmd.ClientConfig.
type inner = clientcmd.ClientConfig

// clientConfig is cc with its configs wrapped by p.
type clientConfig struct {
	inner
	pool *Pool
}

func (c *clientConfig) ClientConfig() (*rest.Config, error) {
	cfg, err := c.inner.ClientConfig()
	if err != nil {
		return nil, err
	}
	if err := c.pool.Wrap(cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}
