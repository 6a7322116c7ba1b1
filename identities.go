// The per-identity view of a pool (Pool.Identities), and the warning about a
// client certificate that expires with no newer one in sight.

package sharedtransport

import (
	"cmp"
	"net/url"
	"slices"
	"time"
)

// IdentityInfo describes one identity of a pool when [Pool.Identities] was
// called. It holds no key material, token or proxy password: it is safe to
// log and to export as metrics.
type IdentityInfo struct {
	// Name is the identity's name in the pool's logs: an HMAC under a random
	// key of the pool's, stable for the pool.
	Name string
	// Hosts are the servers the identity sent requests to, as
	// "scheme://host:port"; empty until the first request.
	Hosts []string
	// Proxy is the proxy the identity's configs set, as "scheme://host"
	// (without user info, the proxy's credential); "direct" for none, ""
	// when the environment's proxy settings apply.
	Proxy string
	Files []string // the CA, client certificate and key files watched for rotation
	Auth  AuthKind // what the identity authenticates with at the TLS layer
	// CertSubject and CertNotAfter are the common name and expiry of the
	// client certificate in use; empty for exec plugins and identities
	// without one.
	CertSubject  string
	CertNotAfter time.Time
	Since        time.Time // when the material in use was taken into use

	OpenConns   int    // TCP connections open now, draining ones included
	Dials       uint64 // TCP connections dialed
	Handshakes  uint64 // full TLS handshakes
	Resumptions uint64 // resumed TLS handshakes
	Rotations   uint64 // certificate or CA changes taken into use

	// RotationErrors counts rejected reloads. The last one's error, time
	// and file are kept after a later rotation too (compare LastErrorTime
	// with Since).
	RotationErrors uint64
	LastError      string
	LastErrorTime  time.Time
	LastErrorFile  string
	// FilesError is set while the files have been rejected for longer
	// than the debounce (100 ms): configs built now fail with it, clients
	// built before keep the last good material.
	FilesError string
}

// AuthKind is what an identity authenticates with at the TLS layer.
type AuthKind string

const (
	AuthClientCertificate AuthKind = "client certificate"
	// AuthExecPlugin: a certificate an exec plugin gives at handshake time.
	AuthExecPlugin AuthKind = "exec plugin"
	// AuthInsecure: the server is not verified; a client certificate may
	// be presented besides.
	AuthInsecure AuthKind = "insecure"
	// AuthNone: tokens and basic auth travel per request and are not part
	// of the identity.
	AuthNone AuthKind = "none"
)

// Identities returns a snapshot of the pool's live identities, sorted by
// name. Counters of one identity are read one after another, not at one
// instant.
func (p *Pool) Identities() []IdentityInfo {
	entries := p.reg.live()
	out := make([]IdentityInfo, 0, len(entries))
	for _, e := range entries {
		out = append(out, e.info())
	}
	slices.SortFunc(out, func(a, b IdentityInfo) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// sentTo records u's server among those the identity sent requests to, for
// IdentityInfo.Hosts. A request to the server recorded last (most
// identities have one) allocates nothing: it is in hosts already.
func (e *entry) sentTo(u *url.URL) {
	if last := e.lastHost.Load(); last != nil && last.scheme == u.Scheme && last.host == u.Host {
		return
	}
	h := u.Scheme + "://" + u.Host
	if _, ok := e.hosts.Load(h); !ok {
		e.hosts.Store(h, struct{}{})
	}
	e.lastHost.Store(&sentHost{u.Scheme, u.Host})
}

func (e *entry) info() IdentityInfo {
	id, g := e.id, e.current.Load()
	info := IdentityInfo{
		Name:           e.name,
		Proxy:          id.key.proxy,
		Since:          g.since,
		OpenConns:      int(e.stats.conn.Open.Load()),
		Dials:          e.stats.conn.Dials.Load(),
		Handshakes:     e.stats.conn.Handshakes.Load(),
		Resumptions:    e.stats.conn.Resumptions.Load(),
		Rotations:      e.stats.rotations.Load(),
		RotationErrors: e.stats.rotationErrors.Load(),
	}
	if c := g.certificate(); c != nil {
		info.CertSubject, info.CertNotAfter = c.Subject.CommonName, c.NotAfter
	}
	if info.Proxy != "" && info.Proxy != "direct" {
		info.Proxy = redactHost(info.Proxy)
	}
	e.hosts.Range(func(h, _ any) bool {
		info.Hosts = append(info.Hosts, redactHost(h.(string)))
		return true
	})
	slices.Sort(info.Hosts)
	for _, f := range []string{id.src.caFile, id.src.certFile, id.src.keyFile} {
		if f != "" {
			info.Files = append(info.Files, f)
		}
	}
	info.Auth = authOf(id, g)
	if f := e.files.lastFailure(); f != nil {
		info.LastError, info.LastErrorTime, info.LastErrorFile = f.err, f.at, f.file
	}
	if id.watchesFiles() {
		info.FilesError = e.filesError()
	}
	return info
}

// authOf says what id authenticates with at the TLS layer in generation g.
func authOf(id *identity, g *generation) AuthKind {
	switch {
	case id.key.insecure:
		return AuthInsecure
	case id.key.getCert != nil:
		return AuthExecPlugin
	case g.material.cert != nil:
		return AuthClientCertificate
	}
	return AuthNone
}
