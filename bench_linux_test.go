//go:build linux

package sharedtransport

import (
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// BenchmarkFileIdentities: 2,000 identities whose certificate, key and CA
// files lie in directories of their own (a controller per tenant, kubelet
// client certificates of many nodes). Reported per identity: what Wrap costs
// when it builds the identity (files read and checked, a transport built, a
// directory watched), and the heap a live identity holds; and what one poll
// of all of them costs when no file changed, wall time and process CPU (the
// median of 5 polls, run as the watcher runs one: every identity queued, each
// reload on a goroutine of its own), with the most goroutines a poll added
// and the OS threads the process made. b.N is ignored: run it with -benchtime 1x.
func BenchmarkFileIdentities(b *testing.B) {
	const n, polls = 2000, 5
	f := newFixture(b, testserver.Options{})
	files := make([]*certDir, n)
	for i := range files {
		files[i] = writeCredFiles(b, filepath.Join(f.dir, "identities", strconv.Itoa(i)), f.ca.CertPEM(), f.alice)
	}
	p := newPool(b, WithPollInterval(0))
	cfgs := make([]*rest.Config, n)
	for i := range cfgs {
		cfgs[i] = files[i].config(f.srv.URL())
	}
	b.ReportAllocs()
	b.ResetTimer()
	start := heapAfterGC()
	wall, cpu := time.Now(), processCPU(b)
	for _, cfg := range cfgs {
		if err := p.Wrap(cfg); err != nil {
			b.Fatal(err)
		}
	}
	wrapWall, wrapCPU := time.Since(wall), processCPU(b)-cpu
	held := heapAfterGC()
	if st := p.Stats(); st.Identities != n {
		b.Fatalf("%d identities, want %d", st.Identities, n)
	}

	var pollWall, pollCPU []time.Duration
	pollGoroutines := 0
	for range polls {
		wall, cpu := time.Now(), processCPU(b)
		pollGoroutines = max(pollGoroutines, pollOnce(b, p))
		pollWall, pollCPU = append(pollWall, time.Since(wall)), append(pollCPU, processCPU(b)-cpu)
	}
	b.StopTimer()
	if st := p.Stats(); st.Rotations != 0 || st.RotationErrors != 0 {
		b.Fatalf("polls of unchanged files: %+v", st)
	}
	runtime.KeepAlive(cfgs)
	slices.Sort(pollWall)
	slices.Sort(pollCPU)
	b.ReportMetric(float64(wrapWall.Microseconds())/n, "wrap-µs/identity")
	b.ReportMetric(float64(wrapCPU.Microseconds())/n, "wrap-cpu-µs/identity")
	b.ReportMetric(float64(int64(held)-int64(start))/n, "B/identity")
	b.ReportMetric(float64(pollWall[polls/2].Microseconds())/1000, "poll-ms")
	b.ReportMetric(float64(pollCPU[polls/2].Microseconds())/1000, "poll-cpu-ms")
	b.ReportMetric(float64(pollCPU[polls/2].Nanoseconds())/n/1000, "poll-cpu-µs/identity")
	b.ReportMetric(float64(pollGoroutines), "poll-goroutines")
	b.ReportMetric(float64(pprof.Lookup("threadcreate").Count()), "os-threads")
}

// pollOnce queues a reload of every watched identity, as a poll does, and
// returns once each has read its files, with the most goroutines seen
// beyond those there before.
func pollOnce(b *testing.B, p *Pool) (extraGoroutines int) {
	before, start := runtime.NumGoroutine(), time.Now()
	p.reg.watcher.reloadAll()
	deadline := time.Now().Add(time.Minute)
	for _, e := range p.reg.live() {
		for read := false; !read; {
			extraGoroutines = max(extraGoroutines, runtime.NumGoroutine()-before)
			e.files.mu.Lock()
			read = !e.files.readAt.Before(start)
			e.files.mu.Unlock()
			if !read && time.Now().After(deadline) {
				b.Fatal("a poll did not end in a minute")
			}
			if !read {
				runtime.Gosched()
			}
		}
	}
	return extraGoroutines
}

// processCPU is the user and system CPU time this process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
