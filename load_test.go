package sharedtransport

// The load loops: bounded workers issuing requests, their errors collected.

import (
	"runtime/debug"
	"sync"
	"testing"
)

// runClients runs clients goroutines of requests calls each, started
// together, and returns the errors.
func runClients(clients, requests int, call func(client, i int) error) []error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	start := make(chan struct{})
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range requests {
				if err := call(c, i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

func checkNoErrors(t testing.TB, errs []error) {
	t.Helper()
	for i, err := range errs {
		if i == 5 {
			t.Errorf("... %d errors in all", len(errs))
			break
		}
		t.Error(err)
	}
}

// requireNoErrors is checkNoErrors, and the test stops on an error.
func requireNoErrors(t testing.TB, errs []error) {
	t.Helper()
	checkNoErrors(t, errs)
	if len(errs) > 0 {
		t.FailNow()
	}
}

// raceDetector reports whether the test binary was built with -race. The
// race detector slows TLS handshakes about tenfold, so the load tests send
// fewer requests under it; every path is still raced.
func raceDetector() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}
