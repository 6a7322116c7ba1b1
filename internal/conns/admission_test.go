package conns

import (
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
