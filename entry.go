// An identity's place in a pool and how long it stays: the registry of
// entries, each built once at first use; the leases that hold an entry,
// held by configs Wrap shared and the clients built from them, weakly by
// hooks; and the idle grace that releases an entry after its last lease is
// collected.

package sharedtransport

import (
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"golang.org/x/sync/singleflight"
	"k8s.io/client-go/rest"
)

// registry holds a pool's entries by identity.
//
// Locks are taken in this order, never the other way: the registry's mu, or
// a rotation's (rotation.go), never both. A hook's mu (wrapper.go), a
// weakLease's and an entry's clientGoMu are held alone, across no call.
type registry struct {
	*env
	group singleflight.Group // one build per identity under concurrent first use

	mu      sync.Mutex // guards entries, closed, watcher, released and wrapped
	entries map[identityKey]*leasedEntry
	closed  bool
	watcher *fileWatcher // nil until a config names certificate files
	// released sums the counters of the identities released, which have
	// no connection open.
	released Stats
	// expiring counts the idle timers set and not stopped, so that close
	// returns after any expiry in progress.
	expiring sync.WaitGroup
	// wrapped are the configs Wrap installed a hook on, while they live: a
	// second Wrap of one changes nothing.
	wrapped map[weak.Pointer[rest.Config]]struct{}
}

// leasedEntry is an entry in the registry and the leases that hold it.
type leasedEntry struct {
	e    *entry
	refs int         // leases not yet collected
	idle *time.Timer // releases the entry at the end of the idle grace
}

// entry is one identity's place in the pool: its material over time, and
// what its clients met.
type entry struct {
	rotation
	hosts    sync.Map                 // "scheme://host" -> struct{}: the servers the identity sent requests to
	lastHost atomic.Pointer[sentHost] // the one sentTo recorded last, in hosts already

	// clientGo are the transports client-go's cache held for the
	// identity's configs (hook.cachedByClientGo) while clientGoFor was
	// current.
	clientGoMu  sync.Mutex // guards clientGo and clientGoFor
	clientGo    []http.RoundTripper
	clientGoFor uint64 // a generation's seq
}

// sentHost is a server an identity sent requests to.
type sentHost struct{ scheme, host string }

// share is what Wrap (viaHook) and TransportFor make of cfg: what it is
// and, when the pool shares it, a lease on its identity's entry. A config
// passed through is counted and logged and gets no lease; so does one Wrap
// wrapped already, whose hook decides for every client.
func (r *registry) share(cfg *rest.Config, d declaration, viaHook bool) (sharing, *lease, error) {
	if r.isClosed() {
		return sharing{}, nil, ErrClosed
	}
	if viaHook && r.wrappedBefore(cfg) {
		return sharing{}, nil, nil
	}
	s, share, err := sharingFor(cfg, d, r.opts.dialIdentity, viaHook)
	if err != nil || !share {
		if err == nil {
			r.passedThrough(cfg, s.pass, s.proxyErr)
		}
		return s, nil, err
	}
	l, err := r.acquire(s.id)
	return s, l, err
}

// acquire returns a lease on id's entry, building the entry at first use
// (once under concurrent first uses). An entry already there serves a
// config built now only while its files hold what it uses (rotation.checkForNewConfig).
func (r *registry) acquire(id *identity) (*lease, error) {
	built := false
	for {
		e, err := r.leaseEntry(id)
		if err != nil {
			return nil, err
		}
		if e != nil {
			if err := e.checkForNewConfig(); err != nil {
				r.release(e)
				return nil, err
			}
			if !built {
				r.stats.hits.Add(1)
			}
			return r.newLease(e), nil
		}
		b, err := r.buildOnce(id)
		if err != nil {
			return nil, err
		}
		built = built || b // if it expired before the lease was taken, the loop builds it again
	}
}

// leaseEntry counts a new reference to id's entry and returns it, or nil
// when there is none.
func (r *registry) leaseEntry(id *identity) (*entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	h, ok := r.entries[id.key]
	if !ok {
		return nil, nil
	}
	h.refs++
	r.stopIdleLocked(h) // a pending release
	return h.e, nil
}

// buildOnce puts an entry for id in the registry unless one is there, once
// for concurrent callers; built reports that this call's build put it there.
func (r *registry) buildOnce(id *identity) (built bool, err error) {
	_, err, _ = r.group.Do(string(r.mac(id.key)), func() (any, error) {
		built, err = r.addEntry(id)
		return nil, err
	})
	return built, err
}

// addEntry builds id's entry and puts it in the registry, unless one is there.
func (r *registry) addEntry(id *identity) (added bool, err error) {
	r.mu.Lock()
	_, ok := r.entries[id.key]
	r.mu.Unlock()
	if ok {
		return false, nil
	}
	e, err := r.build(id)
	if err != nil {
		return false, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		e.close()
		return false, ErrClosed
	}
	r.entries[id.key] = &leasedEntry{e: e}
	r.stats.misses.Add(1)
	return true, nil
}

func (r *registry) build(id *identity) (*entry, error) {
	e := &entry{rotation: rotation{env: r.env, id: id, name: r.nameOf(id.key)}}
	if err := e.load(); err != nil {
		return nil, err
	}
	if id.watchesFiles() {
		w, err := r.fileWatcher()
		if err != nil {
			e.current.Load().transports.Close(ErrClosed)
			return nil, err
		}
		e.watch = w.add(&e.rotation, id.src.caFile, id.src.certFile, id.src.keyFile)
	}
	return e, nil
}

// fileWatcher returns the registry's watcher, starting it at first use.
func (r *registry) fileWatcher() (*fileWatcher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if r.watcher == nil {
		r.watcher = newFileWatcher(watchSettings{
			noEvents: r.opts.disableNotify,
			poll:     r.opts.pollInterval,
			debounce: r.opts.debounce,
			logger:   r.opts.logger,
		})
	}
	return r.watcher, nil
}

// release drops a reference when a lease is collected; the last starts the
// idle grace.
func (r *registry) release(e *entry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.entries[e.id.key]
	if h == nil || h.e != e || r.closed {
		return // closed, or expired with no lease left
	}
	if h.refs--; h.refs == 0 {
		r.expiring.Add(1)
		h.idle = time.AfterFunc(r.opts.idleTimeout, func() {
			defer r.expiring.Done()
			r.expire(e)
		})
	}
}

// stopIdleLocked stops h's idle timer, if it has one; one that fired
// already counts itself out of expiring when its expiry ends.
func (r *registry) stopIdleLocked(h *leasedEntry) {
	if h.idle != nil && h.idle.Stop() {
		r.expiring.Done()
	}
	h.idle = nil
}

// expire releases e when its idle grace ends, unless a lease was taken
// meanwhile.
func (r *registry) expire(e *entry) {
	r.mu.Lock()
	if h := r.entries[e.id.key]; h == nil || h.e != e || h.refs > 0 {
		r.mu.Unlock()
		return
	}
	delete(r.entries, e.id.key)
	r.releasedLocked(e)
	r.mu.Unlock()
	r.opts.logger.V(4).Info("Released an identity no client uses", "identity", e.name)
	e.close()
}

// releasedLocked adds the counters of e, taken out of the registry, to
// those of the identities released before.
func (r *registry) releasedLocked(e *entry) {
	e.stats.addTo(&r.released)
	r.released.OpenConns = 0 // e closes them
}

// sums returns the sums of the counters of the identities live and
// released, and the number live.
func (r *registry) sums() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.released
	for _, h := range r.entries {
		h.e.stats.addTo(&s)
	}
	s.Identities = len(r.entries)
	return s
}

// live returns the registry's entries now.
func (r *registry) live() []*entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	es := make([]*entry, 0, len(r.entries))
	for _, h := range r.entries {
		es = append(es, h.e)
	}
	return es
}

func (r *registry) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// close closes every entry and stops the watcher.
func (r *registry) close() error {
	r.mu.Lock()
	r.closed = true
	entries := r.entries
	r.entries = map[identityKey]*leasedEntry{}
	for _, h := range entries {
		r.stopIdleLocked(h)
		r.releasedLocked(h.e)
	}
	w := r.watcher
	r.mu.Unlock()

	for _, h := range entries {
		h.e.close()
	}
	r.expiring.Wait() // an expiry that began before close took r.mu
	if w != nil {
		return w.close()
	}
	return nil
}

// close closes e's rotation, and lets go of client-go's transports: leases
// may keep a closed entry reachable.
func (e *entry) close() {
	if !e.rotation.close() {
		return
	}
	e.clientGoMu.Lock()
	e.clientGo, e.clientGoFor = nil, 0
	e.clientGoMu.Unlock()
}

// lease is a hold on an entry: while a wrapped config, a copy, or a client
// built from them is reachable, so is its lease, and the entry stays.
type lease struct{ e *entry }

// newLease returns a lease on e, a reference the registry counted: it is
// released when the lease is collected.
func (r *registry) newLease(e *entry) *lease {
	l := &lease{e: e}
	runtime.AddCleanup(l, r.release, e)
	return l
}

// holdLease keeps l reachable until cfg is collected, and cfg recorded as
// wrapped until then: a hook holds its lease weakly (weakLease), and the
// config Wrap was given holds it.
func (r *registry) holdLease(cfg *rest.Config, l *lease) {
	k := weak.Make(cfg)
	r.mu.Lock()
	r.wrapped[k] = struct{}{}
	r.mu.Unlock()
	runtime.AddCleanup(cfg, func(*lease) {
		r.mu.Lock()
		delete(r.wrapped, k)
		r.mu.Unlock()
	}, l)
}

// wrappedBefore reports whether Wrap installed a hook on cfg already.
func (r *registry) wrappedBefore(cfg *rest.Config) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.wrapped[weak.Make(cfg)]
	return ok
}

// weakLease is a hook's hold on a lease. client-go before v0.36 keeps the
// WrapTransport of the first config of each cache key for good (the cached
// transport's certificate callback captures it): a hook holding its lease
// would hold the identity for good. The wrapped config and its clients
// hold the lease; a hook whose lease was collected takes a new one.
type weakLease struct {
	mu sync.Mutex
	p  weak.Pointer[lease]
}

// get returns the lease, taking a new one on id's entry when it was
// collected. Taking one may read the files, so the lock is not held: of two
// taken at once, the first stored is kept.
func (w *weakLease) get(r *registry, id *identity) (*lease, error) {
	w.mu.Lock()
	l := w.p.Value()
	w.mu.Unlock()
	if l != nil {
		return l, nil
	}
	l, err := r.acquire(id)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if kept := w.p.Value(); kept != nil {
		return kept, nil
	}
	w.p = weak.Make(l)
	return l, nil
}
