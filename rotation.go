// Certificate rotation: re-reading an identity's files, from a file event,
// a poll, or a config built now (see fresh), and taking valid new material
// into use by swapping in a new generation and draining the old one.
// Watching the files is in watch.go; reading and validating them in
// material.go.

package sharedtransport

import (
	"errors"
	"sync"
	"time"
)

// filesState is what an entry knows of its files from their last read.
type filesState struct {
	// mu serializes the reads that may rotate (a reload, a fresh check), so
	// an older read never replaces what a newer one took; it guards the
	// fields below. See Pool for the order of locks.
	mu       sync.Mutex
	readAt   time.Time // when the files were last read (options.now)
	err      error     // why that read was rejected; nil: the files hold the material in use
	badSince time.Time // when the reads began to be rejected
	rejected *material // the material rejected last, so unchanged bad files are counted once
}

// reload re-reads the identity's files for the watcher. Every poll and event
// also looks at the expiry of the certificate in use: when no newer file
// arrives, that is the certificate that expires.
func (iw *identityWatch) reload() {
	e := iw.e
	if e.closed.Load() {
		return
	}
	e.files.mu.Lock()
	e.refreshLocked(iw.w.done)
	e.files.mu.Unlock()
	e.checkExpiry()
}

// fresh holds a config built now to what e's files hold now: it re-reads
// them when their last read is older than the debounce or was rejected (a
// config is never refused on a stale read), and fails with the files' error
// when they have been rejected for longer than the debounce. A
// rejection younger than that may be a rotation in progress (a pair written
// one file after the other): fresh waits for the rest of the debounce and
// reads once more. So a config gets material that was on disk at most the
// debounce plus one read ago, and a rotation half written never fails one.
func (e *entry) fresh() error {
	if !e.id.watchesFiles() {
		return nil
	}
	p, st := e.pool, &e.files
	for waited := false; ; waited = true {
		st.mu.Lock()
		if st.err != nil || p.opts.now().Sub(st.readAt) >= p.opts.debounce {
			e.refreshLocked(e.watch.w.done)
		}
		err, wait := st.err, st.badSince.Add(p.opts.debounce).Sub(p.opts.now())
		st.mu.Unlock()
		if err == nil || waited || wait <= 0 {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-e.watch.w.done:
			t.Stop()
			return ErrClosed
		}
	}
}

// refreshLocked reads e's files and takes valid new material into use.
// Unchanged bytes are no reload, and cost a read and a comparison. Invalid
// material keeps the last good one and is counted once.
func (e *entry) refreshLocked(done <-chan struct{}) {
	p := e.pool
	m, err := p.readMaterial(e.id, done)
	now := p.opts.now()
	switch {
	case err == nil && m.equal(e.current.Load().material):
		e.goodLocked(now)
		return
	case err == nil:
		// Checked again even when these bytes were rejected before: a
		// certificate not valid yet becomes valid.
		m, err = p.checkRead(e.id, m, now, done)
	}
	switch {
	case errors.Is(err, ErrClosed):
		return
	case err != nil:
		e.rejectLocked(err, m, now)
		return
	}
	if !m.equal(e.current.Load().material) {
		g, err := p.newGeneration(e, m, e.current.Load())
		if err != nil {
			e.rejectLocked(err, m, now)
			return
		}
		if !e.rotate(g, p.opts.drainTimeout) {
			return
		}
		p.stats.rotations.Add(1)
		e.stats.rotations.Add(1)
		p.opts.logger.V(2).Info("Rotated TLS material", "identity", e.id.key, "files", []string{e.id.key.caFile, e.id.key.certFile, e.id.key.keyFile})
	}
	e.goodLocked(now)
}

func (e *entry) goodLocked(now time.Time) {
	st := &e.files
	st.readAt, st.err, st.badSince, st.rejected = now, nil, time.Time{}, nil
	e.filesBad.Store(false)
}

// rejectLocked counts and logs a rejected read, m the material rejected (nil
// if the files could not be read), unless the same bytes were rejected last;
// the last good material stays.
func (e *entry) rejectLocked(err error, m *material, now time.Time) {
	st := &e.files
	again := st.err != nil && m != nil && st.rejected != nil && m.equal(st.rejected)
	if st.err == nil {
		st.badSince = now
	}
	st.readAt, st.err, st.rejected = now, err, m
	e.filesBad.Store(true)
	if again {
		return
	}
	p := e.pool
	p.stats.rotationErrors.Add(1)
	msg := e.recordReloadError(err, now)
	p.opts.logger.Info("Keeping the last good TLS material", "identity", e.id.key, "reason", msg)
}

// filesError is the error configs built now fail with: the files' error once
// they have been rejected for longer than the debounce; "" otherwise.
func (e *entry) filesError() string {
	st := &e.files
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.err == nil || e.pool.opts.now().Sub(st.badSince) < e.pool.opts.debounce {
		return ""
	}
	return st.err.Error()
}

// rotate takes g into use for new requests. The old generation closes its
// connections as they become idle and the ones still active (long watches)
// after drain, so informers re-list when the grace ends rather than all at
// the rotation.
func (e *entry) rotate(g *generation, drain time.Duration) bool {
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		g.conns.Close(ErrClosed)
		return false
	}
	e.since.Store(time.Now().UnixNano()) // before g is visible: see settled
	old := e.current.Swap(g)
	e.mu.Unlock()
	old.conns.Retire(drain)
	return true
}
