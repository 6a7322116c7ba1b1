// Root pools numbered by content, for TLSTransport's identities: a
// *x509.CertPool cannot be compared as a key, only with Equal.

package sharedtransport

import (
	"bytes"
	"crypto/sha256"
	"crypto/x509"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"weak"
)

// rootsTable numbers root pools by content: Equal pools get one number
// while the first of them is alive (an identity holds it). Pools are
// bucketed by a digest of their subjects and compared within a bucket.
type rootsTable struct {
	mu   sync.Mutex // guards seen and next
	seen map[[sha256.Size]byte][]seenRoots
	next uint64
}

type seenRoots struct {
	pool weak.Pointer[x509.CertPool]
	id   uint64
}

type seenKey struct {
	bucket [sha256.Size]byte
	id     uint64
}

// id returns the number of roots' content; 0 for nil.
func (t *rootsTable) id(roots *x509.CertPool) uint64 {
	if roots == nil {
		return 0
	}
	bucket := subjectsDigest(roots)
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.seen[bucket] {
		if p := r.pool.Value(); p != nil && p.Equal(roots) {
			return r.id
		}
	}
	if t.seen == nil {
		t.seen = map[[sha256.Size]byte][]seenRoots{}
	}
	t.next++
	t.seen[bucket] = append(t.seen[bucket], seenRoots{weak.Make(roots), t.next})
	runtime.AddCleanup(roots, t.forget, seenKey{bucket, t.next})
	return t.next
}

// forget drops the record of a pool that was collected.
func (t *rootsTable) forget(k seenKey) {
	t.mu.Lock()
	defer t.mu.Unlock()
	rest := slices.DeleteFunc(t.seen[k.bucket], func(r seenRoots) bool { return r.id == k.id })
	if len(rest) == 0 {
		delete(t.seen, k.bucket)
	} else {
		t.seen[k.bucket] = rest
	}
}

// subjectsDigest digests the sorted subjects of roots' certificates, which
// Equal pools share. A system pool's Subjects leaves the system's roots
// out: such pools share a bucket, and Equal tells them apart.
func subjectsDigest(roots *x509.CertPool) [sha256.Size]byte {
	h := sha256.New()
	subjects := roots.Subjects() //nolint:staticcheck // see above
	slices.SortFunc(subjects, bytes.Compare)
	for _, s := range subjects {
		fmt.Fprintf(h, "%d:", len(s))
		h.Write(s)
	}
	return [sha256.Size]byte(h.Sum(nil))
}
