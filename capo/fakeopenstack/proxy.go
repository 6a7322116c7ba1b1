package fakeopenstack

import "github.com/sharedtransport/sharedtransport/internal/connectproxy"

// Proxy is an HTTP CONNECT proxy on loopback, as a site's egress proxy, that
// resolves the names it is given itself.
type Proxy struct{ p *connectproxy.Proxy }

// StartProxy starts a proxy that reaches each name of hosts at its address.
func StartProxy(hosts map[string]string) (*Proxy, error) {
	p, err := connectproxy.Start(connectproxy.Options{Hosts: hosts})
	return &Proxy{p}, err
}

// URL is the proxy's http:// URL, as HTTPS_PROXY gives it.
func (p *Proxy) URL() string { return p.p.URL() }

// Tunnels is how many CONNECTs the proxy answered 200.
func (p *Proxy) Tunnels() int { return int(p.p.Stats().Tunnels) }

// Close stops the proxy and its tunnels.
func (p *Proxy) Close() error { return p.p.Close() }
