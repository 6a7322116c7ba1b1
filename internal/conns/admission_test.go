package conns

import (
	"context"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestGrowWait: how long a host's full connections keep requests waiting
// before a lead goes to get another: loneWait for one, loneWait/n for n,
// never less than growAfter, and a quarter of the time left to a waiting
// request's deadline when that is sooner.
func TestGrowWait(t *testing.T) {
	full := time.Now()
	for _, tc := range []struct {
		waiting   int
		growAfter time.Duration
		due       time.Duration // after the connections filled; 0: no deadline
		want      time.Duration
	}{
		{1, growWait, 0, loneWait},
		{2, growWait, 0, loneWait / 2},
		{10, growWait, 0, growWait},
		{50, growWait, 0, growWait},
		{5, maxGrowWait, 0, maxGrowWait},
		{1, growWait, 90 * time.Millisecond, 90 * time.Millisecond / 4},
		{1, growWait, time.Second, loneWait},
		{1, growWait, 20 * time.Millisecond, growWait},
		{1, growWait, -time.Second, growWait}, // past its deadline: the wait has ended it
	} {
		h := &host{growAfter: tc.growAfter, fullSince: full}
		var deadline time.Time
		if tc.due != 0 {
			deadline = full.Add(tc.due)
		}
		if got := h.growWaitLocked(tc.waiting, deadline); got != tc.want {
			t.Errorf("%d waiting, growAfter %v, due %v after the connections filled: %v, want %v", tc.waiting, tc.growAfter, tc.due, got, tc.want)
		}
	}
}

// TestLoneWaitSleeps: a lone request waiting on a full HTTP/2 connection
// sleeps until it goes to get another (loneWait): the wait it sleeps for
// and the wait admission checks count the same requests, so it never wakes
// early into a loop of zero-length waits. The process's CPU time over the
// wait shows such a loop (it spins for what the shorter count leaves).
func TestLoneWaitSleeps(t *testing.T) {
	proto := &atomic.Int32{}
	proto.Store(protoHTTP2)
	h := &host{proto: proto, http2: true, closedCh: make(chan struct{}), bodies: &bodySet{},
		streamsPerConn: firstStreams, growAfter: growWait, conns: 1, inFlight: firstStreams}
	cpu0, start := processCPU(t), time.Now()
	p, err := h.admit(context.Background())
	waited, cpu := time.Since(start), processCPU(t)-cpu0
	if err != nil || !p.lead {
		t.Fatalf("a lone request on a full connection: %+v, %v; want a lead", p, err)
	}
	t.Logf("waited %v before leading; the process used %v of CPU meanwhile", waited, cpu)
	if waited < loneWait {
		t.Errorf("led after %v, want at least %v", waited, loneWait)
	}
	if cpu > loneWait/4 {
		t.Errorf("the process used %v of CPU over a %v wait: the wait spins", cpu, waited)
	}
}

func processCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
