// Package prometheus exports the state of a [sharedtransport.Pool] as
// Prometheus metrics. It is a module of its own, so that the library does not
// depend on a metrics library.
//
// Pool totals are named sharedtransport_*; the same counts per identity are
// named sharedtransport_identity_* and labelled by the identity's redacted
// name and the hosts it talks to. An identity's series disappear when the
// pool releases it, so the pool totals are not the sum of the identities'.
package prometheus

import (
	"strings"

	prom "github.com/prometheus/client_golang/prometheus"

	"github.com/sharedtransport/sharedtransport"
)

const namespace = "sharedtransport"

var identityLabels = []string{"identity", "host"}

func desc(name, help string, labels ...string) *prom.Desc {
	return prom.NewDesc(namespace+"_"+name, help, labels, nil)
}

var (
	identitiesDesc   = desc("identities", "Identities with a live transport.")
	connectionsDesc  = desc("connections", "TCP connections open now.")
	dialsDesc        = desc("dials_total", "TCP connections dialed.")
	handshakesDesc   = desc("handshakes_total", "TLS handshakes, by kind: full or resumed.", "kind")
	rotationsDesc    = desc("rotations_total", "Certificate or CA changes taken into use.")
	rotationErrsDesc = desc("rotation_errors_total", "Reloads rejected; the last good material was kept.")
	hitsDesc         = desc("cache_hits_total", "Wrap calls that found their identity's transport.")
	missesDesc       = desc("cache_misses_total", "Wrap calls that built a transport.")
	passThroughDesc  = desc("pass_through_total", "Configs and round trippers left to client-go.")

	idConnectionsDesc  = desc("identity_connections", "TCP connections of the identity open now.", identityLabels...)
	idDialsDesc        = desc("identity_dials_total", "TCP connections the identity dialed.", identityLabels...)
	idHandshakesDesc   = desc("identity_handshakes_total", "TLS handshakes of the identity, by kind: full or resumed.", append(identityLabels, "kind")...)
	idRotationsDesc    = desc("identity_rotations_total", "Certificate or CA changes the identity took into use.", identityLabels...)
	idRotationErrsDesc = desc("identity_rotation_errors_total", "Reloads of the identity's files rejected.", identityLabels...)
	idLastErrorDesc    = desc("identity_last_rotation_error_timestamp_seconds", "When the identity's last reload was rejected, in Unix seconds.", identityLabels...)
	expiryDesc         = desc("certificate_expiry_timestamp_seconds", "When the client certificate the identity presents expires, in Unix seconds.", identityLabels...)
)

// Collector is a [prom.Collector] over a pool. Each scrape takes one
// [sharedtransport.Pool.Stats] and one [sharedtransport.Pool.Identities].
type Collector struct {
	pool *sharedtransport.Pool
}

var _ prom.Collector = (*Collector)(nil)

// NewCollector returns a collector of p's metrics; register it with a
// [prom.Registerer].
func NewCollector(p *sharedtransport.Pool) *Collector { return &Collector{pool: p} }

// Describe sends the descriptors of every metric the collector exports.
func (c *Collector) Describe(ch chan<- *prom.Desc) {
	for _, d := range []*prom.Desc{
		identitiesDesc, connectionsDesc, dialsDesc, handshakesDesc, rotationsDesc, rotationErrsDesc,
		hitsDesc, missesDesc, passThroughDesc,
		idConnectionsDesc, idDialsDesc, idHandshakesDesc, idRotationsDesc, idRotationErrsDesc, idLastErrorDesc, expiryDesc,
	} {
		ch <- d
	}
}

// Collect sends the pool's metrics as they are now.
func (c *Collector) Collect(ch chan<- prom.Metric) {
	st := c.pool.Stats()
	gauge := func(d *prom.Desc, v float64, labels ...string) {
		ch <- prom.MustNewConstMetric(d, prom.GaugeValue, v, labels...)
	}
	counter := func(d *prom.Desc, v uint64, labels ...string) {
		ch <- prom.MustNewConstMetric(d, prom.CounterValue, float64(v), labels...)
	}
	gauge(identitiesDesc, float64(st.Identities))
	gauge(connectionsDesc, float64(st.OpenConns))
	counter(dialsDesc, st.Dials)
	counter(handshakesDesc, st.Handshakes, "full")
	counter(handshakesDesc, st.Resumptions, "resumed")
	counter(rotationsDesc, st.Rotations)
	counter(rotationErrsDesc, st.RotationErrors)
	counter(hitsDesc, st.Hits)
	counter(missesDesc, st.Misses)
	counter(passThroughDesc, st.PassThrough)

	for _, id := range c.pool.Identities() {
		// One series per identity: an identity that talks to several hosts
		// has them joined, so its counts are not repeated per host.
		l := []string{id.Name, strings.Join(id.Hosts, ",")}
		gauge(idConnectionsDesc, float64(id.OpenConns), l...)
		counter(idDialsDesc, id.Dials, l...)
		counter(idHandshakesDesc, id.Handshakes, append(l, "full")...)
		counter(idHandshakesDesc, id.Resumptions, append(l, "resumed")...)
		counter(idRotationsDesc, id.Rotations, l...)
		counter(idRotationErrsDesc, id.RotationErrors, l...)
		if !id.LastErrorTime.IsZero() {
			gauge(idLastErrorDesc, float64(id.LastErrorTime.UnixNano())/1e9, l...)
		}
		if !id.CertNotAfter.IsZero() {
			gauge(expiryDesc, float64(id.CertNotAfter.Unix()), l...)
		}
	}
}
