// Certificate rotation: re-reading an identity's files, from a file event,
// a poll, or a config built now (see fresh), and taking valid new material
// into use by swapping in a new generation and draining the old one.
// Watching the files is in watch.go; reading and validating them in
// material.go.

package sharedtransport

import (
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"
)

// filesState is everything an entry knows of its files: the last read,
// the last rejection, and whether a debounced reload is on its way.
type filesState struct {
	// reloading serializes the reads that may rotate (a reload, a fresh
	// check), so an older read never replaces what a newer one took. It is
	// held across the read; only other such reads wait for it.
	reloading sync.Mutex

	mu       sync.Mutex // guards the fields below; never held across a read
	readAt   time.Time  // when the files were last read (options.now)
	err      error      // why that read was rejected; nil: the files hold the material in use
	badSince time.Time  // when the reads began to be rejected
	rejected *material  // the material rejected last, so unchanged bad files are counted once
	last     *reloadFailure
	due      bool // a debounced reload is on its way to the watcher's queue
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

// setDue marks a debounced reload on its way, and reports whether none was.
func (st *filesState) setDue(due bool) (was bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	was, st.due = st.due, due
	return was
}

// reload re-reads the identity's files for the watcher. Every poll and event
// also looks at the expiry of the certificate in use: when no newer file
// arrives, that is the certificate that expires.
func (e *entry) reload(done <-chan struct{}) {
	if e.closed.Load() {
		return
	}
	e.files.reloading.Lock()
	e.refresh(done)
	e.files.reloading.Unlock()
	e.checkExpiry()
}

func (e *entry) markDue(due bool) (was bool) { return e.files.setDue(due) }

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
	opts, st := &e.env.opts, &e.files
	stale := func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.err != nil || opts.now().Sub(st.readAt) >= opts.debounce
	}
	for waited := false; ; waited = true {
		// A fresh good read is used without waiting for a reload in flight
		// (a hung file system holds one for up to the read timeout).
		if stale() {
			st.reloading.Lock()
			if stale() { // not read meanwhile by the reload waited for
				e.refresh(e.watch.w.done)
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
// caller holds e.files.reloading. Unchanged bytes are no reload, and cost a
// read and a comparison. Invalid material keeps the last good one and is
// counted once.
func (e *entry) refresh(done <-chan struct{}) {
	v := e.env
	m, err := readMaterial(&v.files, e.id, done)
	now := v.opts.now()
	switch {
	case err == nil && m.equal(e.current.Load().material):
		e.files.good(now)
		return
	case err == nil:
		// Checked again even when these bytes were rejected before: a
		// certificate not valid yet becomes valid.
		m, err = checkRead(&v.files, e.id, m, v.opts.now, done)
	}
	switch {
	case errors.Is(err, errStopped):
		return
	case err != nil:
		e.reject(err, m, now)
		return
	}
	if !m.equal(e.current.Load().material) {
		g, err := newGeneration(e.id, m, e.current.Load(), &v.opts, &v.stats.conn, &e.stats.conn)
		if err != nil {
			e.reject(err, m, now)
			return
		}
		if !e.rotate(g, v.opts.drainTimeout) {
			return
		}
		v.stats.rotations.Add(1)
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

// reject counts and logs a rejected read, m the material rejected (nil if
// the files could not be read), unless the same bytes were rejected last;
// the last good material stays.
func (e *entry) reject(err error, m *material, now time.Time) {
	if !e.files.rejectedAgain(err, m, now, e.id.key) {
		e.env.stats.rotationErrors.Add(1)
		e.stats.rotationErrors.Add(1)
		e.env.opts.logger.Info("Keeping the last good TLS material", "identity", e.id.key, "reason", err.Error())
	}
}

// rejectedAgain records a rejected read and reports whether the same bytes
// were rejected last. A new failure is kept for Identities with the first of
// the identity's files its text names: every reload error names the file it
// is about.
func (st *filesState) rejectedAgain(err error, m *material, now time.Time, k identityKey) bool {
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
	msg := err.Error()
	st.last = &reloadFailure{err: msg, at: now}
	for _, path := range []string{k.certFile, k.keyFile, k.caFile} {
		if path != "" && strings.Contains(msg, strconv.Quote(path)) {
			st.last.file = path
			break
		}
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
