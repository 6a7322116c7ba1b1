// Certificate rotation: re-reading an identity's files (after a file event,
// a poll, or for a config built now) and taking valid new material into use
// by swapping in a new generation and draining the old one.

package sharedtransport

import (
	"errors"
	"sync"
	"time"
)

// filesState is everything an entry knows of its files: the last read and
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

// reload re-reads the identity's files for the watcher.
func (e *entry) reload() {
	if e.closed.Load() {
		return
	}
	e.files.reloading.Lock()
	e.refresh()
	e.files.reloading.Unlock()
}

// fresh holds a config built now to what e's files hold now: it re-reads
// them when their last read is older than the debounce or was rejected,
// and fails with the files' error once they have been rejected for longer
// than the debounce. A younger rejection may be a pair written file after
// file: fresh waits out the debounce and reads once more. So a config gets
// material at most the debounce plus one read old, and a rotation half
// written never fails one.
func (e *entry) fresh() error {
	if !e.id.watchesFiles() {
		return nil
	}
	opts, st := &e.env.opts, &e.files
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
				e.refresh()
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
		case <-e.watch.w.done:
			t.Stop()
			return ErrClosed
		}
	}
}

// refresh reads e's files and takes valid new material into use; the
// caller holds e.files.reloading. Unchanged bytes cost a read and a
// comparison. Invalid material keeps the last good one, counted once.
func (e *entry) refresh() {
	v := e.env
	m, err := readMaterial(e.id)
	now := v.opts.now()
	switch {
	case err == nil && m.equal(e.current.Load().material):
		e.files.good(now)
		return
	case err == nil:
		// Checked even when these bytes were rejected before: a certificate
		// not valid yet becomes valid.
		m, err = checkRead(e.id, m, v.opts.now)
	}
	if err != nil {
		e.reject(err, m, now)
		return
	}
	if !m.equal(e.current.Load().material) {
		g, err := newGeneration(e.id, m, e.current.Load(), v, &e.stats.conn)
		if err != nil {
			e.reject(err, m, now)
			return
		}
		if !e.rotate(g, v.opts.drainTimeout) {
			return
		}
		e.stats.rotations.Add(1)
		v.opts.logger.V(2).Info("Rotated TLS material", "identity", e.id.key, "files", []string{e.id.key.caFile, e.id.key.certFile, e.id.key.keyFile})
	}
	e.files.good(now)
}

func (st *filesState) good(now time.Time) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.readAt, st.err, st.badSince, st.rejected = now, nil, time.Time{}, nil
}

// reject counts and logs a rejected read of m (nil: unreadable files),
// unless the same bytes were rejected last.
func (e *entry) reject(err error, m *material, now time.Time) {
	if !e.files.rejectedAgain(err, m, now) {
		e.stats.rotationErrors.Add(1)
		e.env.opts.logger.Info("Keeping the last good TLS material", "identity", e.id.key, "reason", err.Error())
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
func (e *entry) filesError() string {
	st := &e.files
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.err == nil || e.env.opts.now().Sub(st.badSince) < e.env.opts.debounce {
		return ""
	}
	return st.err.Error()
}

// rotate takes g into use. The old generation closes its connections as
// they become idle and the rest (long watches) after drain, so informers
// re-list spread out rather than all at the rotation.
func (e *entry) rotate(g *generation, drain time.Duration) bool {
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		g.conns.Close(ErrClosed)
		return false
	}
	old := e.current.Swap(g)
	e.mu.Unlock()
	old.conns.Retire(drain)
	return true
}
