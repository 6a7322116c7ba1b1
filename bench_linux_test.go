//go:build linux

package sharedtransport

import (
	"path/filepath"
	"runtime"
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
// median of 5 polls, each identity re-read in turn on one goroutine). b.N is
// ignored: run it with -benchtime 1x.
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
	for range polls {
		wall, cpu := time.Now(), processCPU(b)
		pollOnce(p)
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
}

// pollOnce re-reads every watched identity's files in turn, as a poll does.
func pollOnce(p *Pool) {
	for _, iw := range p.reg.watcher.all() {
		iw.r.reload()
	}
}

// processCPU is the user and system CPU time this process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
