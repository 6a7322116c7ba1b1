// The options New takes, their defaults, and the environment every layer of
// a pool shares: options, the counters Stats reports, and ErrClosed.

package sharedtransport

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/sharedtransport/sharedtransport/internal/conns"
)

// ErrClosed is returned by [Pool.Wrap] and [Pool.TransportFor] on a closed
// pool, by requests sent through a closed pool's transports, and by requests
// and response bodies whose connection [Pool.Close] closed under them.
var ErrClosed = errors.New("sharedtransport: pool is closed")

// env is what every layer of a pool reads and counts into. A Pool owns one;
// its registry, entries, hooks and watcher refer to it, never to the Pool.
type env struct {
	opts  options
	stats counters
	// generations numbers the pool's generations (generation.seq).
	generations atomic.Uint64
	nameKey     [32]byte   // random: keys the names identities are logged by (env.mac)
	roots       rootsTable // numbers the root pools TLSTransport is given

	undeclaredOnce sync.Once // logs the first config passed through for undeclared wrappers
	functionsOnce  sync.Once // logs the first config Wrap passes through for its Proxy or Dial
}

// Stats are plain counters of what a pool did since it was created.
type Stats struct {
	Identities int // identities with a live transport

	// Hits and Misses count the lookups of an identity's transport: one per
	// [Pool.Wrap] and [Pool.TransportFor] of a config the pool shares, and
	// one when a hook takes its released identity again ([WithIdleTimeout]).
	// A miss built the transport; a hit found it, or waited for it.
	Hits   uint64
	Misses uint64
	// PassThrough counts what is left to client-go's own transport: each
	// config [Pool.Wrap] or [Pool.TransportFor] does not share, and, once,
	// each client of a wrapped config that keeps client-go's transport (SPDY
	// or websocket, a copy of another identity, files failing to load).
	PassThrough uint64

	WrapErrors     uint64 // configs the [Pool.WrapConfigFn] adapter left unwrapped
	Dials          uint64 // TCP connections dialed
	OpenConns      int    // TCP connections open now
	Handshakes     uint64 // full TLS handshakes
	Resumptions    uint64 // resumed TLS handshakes
	Rotations      uint64 // certificate or CA changes taken into use
	RotationErrors uint64 // reloads rejected (the last good material was kept)
}

// counters are what the pool counts itself; what happens to an identity's
// connections and files is counted by the identity (identityCounters), and
// the pool's figures are their sums.
type counters struct {
	hits, misses, passThrough, wrapErrors atomic.Uint64
}

// identityCounters are one identity's counters.
type identityCounters struct {
	conn                      conns.Counters
	rotations, rotationErrors atomic.Uint64
}

// addTo adds c's figures to s.
func (c *identityCounters) addTo(s *Stats) {
	s.Dials += c.conn.Dials.Load()
	s.OpenConns += int(c.conn.Open.Load())
	s.Handshakes += c.conn.Handshakes.Load()
	s.Resumptions += c.conn.Resumptions.Load()
	s.Rotations += c.rotations.Load()
	s.RotationErrors += c.rotationErrors.Load()
}

// An Option configures a [Pool]. Options are applied by [New] in order, after
// the defaults are set.
type Option func(*options)

type options struct {
	keepAlive         bool
	sessionResumption bool
	idleTimeout       time.Duration
	dialIdentity      func(*rest.Config) string
	pollInterval      time.Duration
	drainTimeout      time.Duration
	logger            klog.Logger

	// Test seams, never exported.
	debounce      time.Duration    // how long file events settle before a reload
	disableNotify bool             // poll only
	now           func() time.Time // the clock certificates are checked against
}

func defaultOptions() options {
	return options{
		keepAlive:         true,
		sessionResumption: true,
		idleTimeout:       90 * time.Second,
		pollInterval:      30 * time.Second,
		drainTimeout:      2 * time.Minute,
		logger:            klog.Background().WithName("sharedtransport"),
		debounce:          100 * time.Millisecond,
		now:               time.Now,
	}
}

// WithIdleTimeout sets how long an identity no client refers to any more
// keeps its connections before they are closed and its memory released:
// code that builds a config per request reuses the connection between two
// sparse requests. The default, 90 seconds, is client-go's idle-connection
// timeout. A negative d is ignored.
func WithIdleTimeout(d time.Duration) Option {
	return func(o *options) { setNonNegative(&o.idleTimeout, d) }
}

// WithDialIdentity lets configs with a custom [rest.Config.Dial] share
// transports. Dial functions cannot be compared, so by default such a config
// passes through untouched. fn names the dialer: configs whose fn results are
// equal and non-empty promise that their dialers are interchangeable, and
// share the dialer of the first config seen. An empty result passes the
// config through.
func WithDialIdentity(fn func(cfg *rest.Config) string) Option {
	return func(o *options) { o.dialIdentity = fn }
}

// WithPollInterval sets how often watched certificate and CA files are
// re-read without a file-system event (network and overlay file systems,
// bind mounts, a lost watch); an unchanged file costs a read and a
// comparison. The default is 30 seconds; zero turns polling off. The poll
// also covers directories the kernel refuses to watch (its inotify
// limits), and tries their watch again. A negative d is ignored.
func WithPollInterval(d time.Duration) Option {
	return func(o *options) { setNonNegative(&o.pollInterval, d) }
}

// WithDrainTimeout sets how long connections active when a certificate or
// CA changed (long watches) keep running on the old material. Idle
// connections close at once, the others when their requests end; a request
// not sent yet when they close is sent with the new material. The default
// is 2 minutes, so informers re-list spread out rather than all at the
// rotation. A negative d is ignored.
func WithDrainTimeout(d time.Duration) Option {
	return func(o *options) { setNonNegative(&o.drainTimeout, d) }
}

// WithLogger sets the logger. The default is klog's background logger named
// "sharedtransport". Nothing logged ever contains key material or tokens.
func WithLogger(logger klog.Logger) Option {
	return func(o *options) { o.logger = logger }
}

// setNonNegative sets *dst to v unless v is negative, which options ignore.
func setNonNegative[T int | time.Duration](dst *T, v T) {
	if v >= 0 {
		*dst = v
	}
}
