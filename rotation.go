// Certificate rotation: one identity's TLS material over time. A rotation
// holds the generation in use, re-reads the files (after a file event, a
// poll, or for a config built now) and takes valid new material into use by
// swapping in a new generation and draining the old one.

package sharedtransport

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/transport"

	"github.com/sharedtransport/sharedtransport/internal/conns"
)

// rotation is one identity's material over time.
//
// Locks are taken in this order: files.reloading (held across the reads
// it serializes), then mu, then the watcher's, then the connection
// layer's, which never calls back up; files.mu is held alone, across no
// call.
type rotation struct {
	env     *env
	id      *identity
	name    string // what logs and Identities call it (env.nameOf)
	current atomic.Pointer[generation]
	closed  atomic.Bool
	stats   identityCounters
	files   filesState
	watch   *identityWatch // set before the rotation is shared; nil without files

	// mu orders rotate and close, so a generation is never taken into use
	// after close.
	mu sync.Mutex
}

// filesState is everything a rotation knows of its files: the last read and
// the last rejection.
type filesState struct {
	// reloading serializes the reads that may rotate, so an older read never
	// replaces what a newer one took; held across the read.
	reloading sync.Mutex

	mu       sync.Mutex // guards the fields below; never held across a read
	readAt   time.Time  // when the files were last read (options.now)
	err      error      // why that read was rejected; nil: the files hold the material in use
	badSince time.Time  // when the reads began to be rejected
	rejected *material  // the material rejected last, so unchanged bad files are counted once
	last     *reloadFailure
}

// reloadFailure is a rejected reload, as Identities shows it.
type reloadFailure struct {
	err, file string
	at        time.Time
}

// bad reports whether the last read of the files was rejected: the last
// good material serves meanwhile.
func (st *filesState) bad() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.err != nil
}

func (st *filesState) lastFailure() *reloadFailure {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.last
}

// load reads the material and builds the first generation.
func (r *rotation) load() error {
	readAt := r.env.opts.now()
	m, err := loadMaterial(&r.id.src, r.env.opts.now)
	if err != nil {
		return err
	}
	g, err := newGeneration(r.id, m, nil, r.env, &r.stats.conn)
	if err != nil {
		return err
	}
	r.current.Store(g)
	r.files.readAt = readAt
	return nil
}

// reload re-reads the identity's files for the watcher.
func (r *rotation) reload() {
	if r.closed.Load() {
		return
	}
	r.files.reloading.Lock()
	r.refresh()
	r.files.reloading.Unlock()
}

// checkForNewConfig holds a config built now to what the files hold now:
// it re-reads them when their last read is older than the debounce or was
// rejected, and fails with the files' error once they have been rejected
// for longer than the debounce. A younger rejection may be a pair written
// file after file: it waits out the debounce and reads once more. So a
// config gets material at most the debounce plus one read old, and a
// rotation half written never fails one.
func (r *rotation) checkForNewConfig() error {
	if !r.id.watchesFiles() {
		return nil
	}
	opts, st := &r.env.opts, &r.files
	stale := func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.err != nil || opts.now().Sub(st.readAt) >= opts.debounce
	}
	for waited := false; ; waited = true {
		// A fresh good read is used without waiting for a reload in flight.
		if stale() {
			st.reloading.Lock()
			if stale() { // not read meanwhile by the reload waited for
				r.refresh()
			}
			st.reloading.Unlock()
		}
		st.mu.Lock()
		err, wait := st.err, st.badSince.Add(opts.debounce).Sub(opts.now())
		st.mu.Unlock()
		if err == nil || waited || wait <= 0 {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-r.watch.w.done:
			t.Stop()
			return ErrClosed
		}
	}
}

// refresh reads the files and takes valid new material into use; the
// caller holds files.reloading. Unchanged bytes cost a read and a
// comparison. Invalid material keeps the last good one, counted once.
func (r *rotation) refresh() {
	v := r.env
	m, err := readMaterial(&r.id.src)
	now := v.opts.now()
	switch {
	case err == nil && m.equal(r.current.Load().material):
		r.files.good(now)
		return
	case err == nil:
		// Checked even when these bytes were rejected before: a certificate
		// not valid yet becomes valid.
		m, err = checkRead(&r.id.src, m, v.opts.now)
	}
	if err != nil {
		r.reject(err, m, now)
		return
	}
	if !m.equal(r.current.Load().material) {
		g, err := newGeneration(r.id, m, r.current.Load(), v, &r.stats.conn)
		if err != nil {
			r.reject(err, m, now)
			return
		}
		if !r.rotate(g, v.opts.drainTimeout) {
			return
		}
		r.stats.rotations.Add(1)
		v.opts.logger.V(2).Info("Rotated TLS material", "identity", r.name, "files", []string{r.id.src.caFile, r.id.src.certFile, r.id.src.keyFile})
	}
	r.files.good(now)
}

func (st *filesState) good(now time.Time) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.readAt, st.err, st.badSince, st.rejected = now, nil, time.Time{}, nil
}

// reject counts and logs a rejected read of m (nil: unreadable files),
// unless the same bytes were rejected last.
func (r *rotation) reject(err error, m *material, now time.Time) {
	if !r.files.rejectedAgain(err, m, now) {
		r.stats.rotationErrors.Add(1)
		r.env.opts.logger.Info("Keeping the last good TLS material", "identity", r.name, "reason", err.Error())
	}
}

// rejectedAgain records a rejected read and reports whether the same bytes
// were rejected last. A new failure is kept for Identities with the file it
// names.
func (st *filesState) rejectedAgain(err error, m *material, now time.Time) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	again := st.err != nil && m != nil && st.rejected != nil && m.equal(st.rejected)
	if st.err == nil {
		st.badSince = now
	}
	st.readAt, st.err, st.rejected = now, err, m
	if again {
		return true
	}
	st.last = &reloadFailure{err: err.Error(), at: now}
	if refused := (*materialError)(nil); errors.As(err, &refused) {
		st.last.file = refused.file
	}
	return false
}

// filesError is the error configs built now fail with: the files' error once
// they have been rejected for longer than the debounce; "" otherwise.
func (r *rotation) filesError() string {
	st := &r.files
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.err == nil || r.env.opts.now().Sub(st.badSince) < r.env.opts.debounce {
		return ""
	}
	return st.err.Error()
}

// rotate takes g into use. The old generation closes its connections as
// they become idle and the rest (long watches) after drain, so informers
// re-list spread out rather than all at the rotation.
func (r *rotation) rotate(g *generation, drain time.Duration) bool {
	r.mu.Lock()
	if r.closed.Load() {
		r.mu.Unlock()
		g.transports.Close(ErrClosed)
		return false
	}
	old := r.current.Swap(g)
	r.mu.Unlock()
	old.transports.Retire(drain)
	return true
}

// close stops the watches and closes every connection, of draining
// generations too; false when it was closed already.
func (r *rotation) close() bool {
	r.mu.Lock()
	if r.closed.Swap(true) {
		r.mu.Unlock()
		return false
	}
	r.mu.Unlock()
	if r.watch != nil {
		r.watch.stop()
	}
	r.current.Load().transports.Close(ErrClosed)
	return true
}

// generation is one version of an identity's TLS material and its
// transports. A rotation builds the next and retires this one.
type generation struct {
	seq        uint64    // unique in the pool, greater for a newer one
	since      time.Time // when it was built, to be taken into use
	material   *material
	ca         digest // of material.caPEM (clientTransport.sameCA)
	transports *conns.Transports
}

// certificate is the client certificate the generation authenticates with;
// nil without one, or with an exec plugin's.
func (g *generation) certificate() *x509.Certificate {
	if g.material.cert == nil {
		return nil
	}
	return g.material.cert.Leaf
}

// newGeneration builds id's transports for m as client-go's
// tlsTransportCache builds its own, with the pool's options, counting into
// counters, the identity's. prev is the generation they take over from; nil
// for the first.
func newGeneration(id *identity, m *material, prev *generation, v *env, counters *conns.Counters) (*generation, error) {
	if len(m.certPEM) > 0 && m.cert == nil {
		return nil, errors.New("sharedtransport: internal error: a client certificate was not checked before use")
	}
	getCert := id.key.getCert
	if m.cert != nil {
		// The pair checkMaterial parsed, not bytes to parse again; it takes
		// precedence over an exec plugin's callback, as in client-go.
		getCert = &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return m.cert, nil }}
	}
	tlsConfig, err := transport.TLSConfigFor(&transport.Config{TLS: transport.TLSConfig{
		Insecure:      id.key.insecure,
		ServerName:    id.key.serverName,
		NextProtos:    id.nextProtos,
		CAData:        m.caPEM,
		GetCertHolder: getCert,
	}})
	if err != nil {
		return nil, err
	}
	if id.tlsConfig != nil {
		tlsConfig = id.tlsConfig // TLSTransport: the caller's own, which holds no material
	}
	g := &generation{seq: v.generations.Add(1), since: time.Now(), material: m, ca: digestOf(m.caPEM)}
	var older *conns.Transports
	if prev != nil {
		older = prev.transports
	}
	g.transports = conns.NewTransports(conns.Config{
		TLS:                tlsConfig,
		Dial:               id.dial,
		Proxy:              id.proxy,
		ProxyConnectHeader: id.connectHeader,
		DisableCompression: id.key.disableCompression,
		DisableHTTP2:       id.key.noHTTP2,
		KeepAlive:          v.opts.keepAlive,
		SessionCache:       v.opts.sessionCache(id),
		Counters:           counters,
	}, older)
	return g, nil
}
