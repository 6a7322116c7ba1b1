package karmada

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/chart"
	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
)

// chartDir, when set (karmada/hack/chart.sh sets it), is where
// TestOwnConnectClusterSeedLoad keeps each run's open tunnels over time and
// draws every run kept there into seed-load.svg: Karmada as is and patched
// run in two test binaries, so the second draws both.
var chartDir = os.Getenv("KARMADA_SEED_CHART")

// sampleTunnels samples p's open tunnels every 20ms until stop is called,
// which returns the samples.
func sampleTunnels(p *connectproxy.Proxy) (stop func() []chart.Point) {
	var (
		points []chart.Point
		done   = make(chan struct{})
		wg     sync.WaitGroup
	)
	start := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			points = append(points, chart.Point{T: time.Since(start).Seconds(), Open: p.Stats().Open})
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() []chart.Point {
		close(done)
		wg.Wait()
		return points
	}
}

// keepRun keeps a run's line in chartDir as its order-th, and redraws the
// chart from every run kept there.
func keepRun(t *testing.T, order int, s chart.Series) {
	if chartDir == "" {
		return
	}
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(chartDir, fmt.Sprintf("run-%d.json", order)), b, 0o644); err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(chartDir, "run-*.json"))
	if err != nil {
		t.Fatal(err)
	}
	c := chart.Chart{
		Title: "Open tunnels to the member cluster through Karmada v1.18.2's ConnectCluster, counted at its proxy",
		Caption: fmt.Sprintf("%d clients x %d requests, each as its own user, through the cluster proxy to a real kube-apiserver; %s",
			seedClients, seedRequests, chart.Commit()),
	}
	for _, f := range files { // run-1, run-2, ...: in order while there are fewer than ten
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var s chart.Series
		if err := json.Unmarshal(b, &s); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		c.Series = append(c.Series, s)
	}
	if err := os.WriteFile(filepath.Join(chartDir, "seed-load.svg"), []byte(c.SVG()), 0o644); err != nil {
		t.Fatal(err)
	}
}
