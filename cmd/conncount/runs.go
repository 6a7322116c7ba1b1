package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/chart"
)

// modeRun is one run of one mode: what its client process measured of its
// own load, and what the target counted meanwhile.
type modeRun struct {
	Mode  string `json:"mode"`
	Round int    `json:"round"` // 1-based
	Seq   int    `json:"seq"`   // 1-based position among all runs
	clientResult
	Accepted        int64  `json:"connections_accepted"`
	PeakOpen        int64  `json:"peak_open"`
	OpenAtEnd       int64  `json:"open_at_end"`
	FullHandshakes  int64  `json:"full_handshakes"`
	Resumed         int64  `json:"resumed_handshakes"`
	HandshakeSource string `json:"handshake_source"`
	// The embedded server's process (none against a cluster).
	ServerPID             int      `json:"server_pid,omitempty"`
	ServerProcessRequests int64    `json:"server_process_requests,omitempty"`
	ServerCPUSeconds      *float64 `json:"server_cpu_seconds,omitempty"`
	ServerCPUPerRequestUs *float64 `json:"server_cpu_per_request_us,omitempty"`
	ServerMaxRSSBytes     int64    `json:"server_max_rss_bytes,omitempty"`
	Samples               []sample `json:"-"`
}

// A sample is the number of connections open a time into the run.
type sample = chart.Point

// runOrder is the order of all runs: repeat rounds of every mode, round r
// (from 0) starting at mode r, so that no mode always follows the same one.
func runOrder(modes []string, repeat int) (names []string, rounds []int) {
	for r := range repeat {
		for i := range modes {
			names = append(names, modes[(r+i)%len(modes)])
			rounds = append(rounds, r+1)
		}
	}
	return names, rounds
}

// runOnce runs one mode once: a fresh target run (for the embedded server,
// a fresh server process) and a fresh client process.
func runOnce(ctx context.Context, o *options, t target, name string, round, seq int, stderr io.Writer) (*modeRun, error) {
	tr, err := t.start(ctx, stderr)
	if err != nil {
		return nil, err
	}
	defer tr.close()
	spec := clientSpec{
		Kubeconfig: tr.kubeconfig(),
		Mode:       name,
		Workers:    o.workers,
		Requests:   o.requests,
		Resource:   o.resource,
		Timeout:    o.timeout,
		Duration:   o.duration,
	}
	if o.cpuProfile != "" {
		spec.CPUProfile = fmt.Sprintf("%s.%s.%d", o.cpuProfile, name, round)
		if abs, err := filepath.Abs(spec.CPUProfile); err == nil {
			spec.CPUProfile = abs
		}
	}
	if o.progress {
		spec.Label = fmt.Sprintf("round %d/%d %-30s", round, o.repeat, name)
	}
	var ready clientReady
	c, err := startChild(ctx, "client", spec, &ready, stderr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if err := tr.begin(ctx, ready.PID); err != nil {
		return nil, err
	}
	var samples []sample
	var stopSampling func()
	if o.svg != "" || t.sampledPeak() {
		stopSampling = sampleOpen(ctx, tr, o.sample, &samples)
	}
	var res clientResult
	err = c.Call(ctx, "run", &res)
	if stopSampling != nil {
		stopSampling()
	}
	if err != nil {
		return nil, err
	}
	sc, err := tr.end(ctx)
	if err != nil {
		return nil, err
	}
	return newModeRun(name, round, seq, res, sc, samples), nil
}

// sampleOpen samples the target's open connections every d until the
// returned function is called.
func sampleOpen(ctx context.Context, tr targetRun, d time.Duration, out *[]sample) (stop func()) {
	quit := make(chan struct{})
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		tick := time.NewTicker(d)
		defer tick.Stop()
		for {
			select {
			case <-quit:
				return
			case <-tick.C:
				if n, err := tr.open(ctx); err == nil {
					*out = append(*out, sample{T: time.Since(start).Seconds(), Open: n})
				}
			}
		}
	}()
	return func() { close(quit); <-done }
}

func newModeRun(name string, round, seq int, res clientResult, sc serverCounts, samples []sample) *modeRun {
	r := &modeRun{
		Mode: name, Round: round, Seq: seq, clientResult: res,
		Accepted: sc.Accepted, PeakOpen: sc.PeakOpen, OpenAtEnd: sc.Open,
		FullHandshakes: sc.FullHandshakes, Resumed: sc.Resumed, HandshakeSource: "server",
		ServerPID: sc.PID, ServerMaxRSSBytes: sc.MaxRSSKiB * 1024,
		Samples: samples,
	}
	if sc.ProcessRequests != unknown {
		r.ServerProcessRequests = sc.ProcessRequests
	}
	if sc.CPU != unknown {
		cpu := sc.CPU.Seconds()
		r.ServerCPUSeconds = &cpu
		if r.Requests > 0 {
			per := cpu * 1e6 / float64(r.Requests)
			r.ServerCPUPerRequestUs = &per
		}
	}
	for _, s := range samples {
		r.PeakOpen = max(r.PeakOpen, int64(s.Open))
	}
	if r.FullHandshakes == unknown {
		if r.Pool != nil {
			r.FullHandshakes, r.Resumed = int64(r.Pool.Handshakes), int64(r.Pool.Resumptions)
			r.HandshakeSource = "library Stats"
		} else {
			r.FullHandshakes, r.Resumed = r.Accepted, 0
			r.HandshakeSource = "inferred (one per connection)"
		}
	}
	return r
}
