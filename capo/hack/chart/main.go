// Command chart draws capo/scope-load.svg from the runs TestSharedScopeLoad
// keeps in CAPO_LOAD_CHART (capo/hack/test-capo.sh with CAPO_CHART set runs
// it): connections ESTABLISHED toward the cloud over time, CAPO as is and
// patched, with CAPO's default scope cache.
//
// Usage: go run ./hack/chart CAPTION RUN.json... > scope-load.svg
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/sharedtransport/sharedtransport/internal/chart"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: chart CAPTION RUN.json... > scope-load.svg")
		os.Exit(2)
	}
	c := chart.Chart{
		Title:   "Connections ESTABLISHED toward the OpenStack API, CAPO's scopes under load, then idle past the grace",
		Caption: os.Args[1],
	}
	for _, f := range os.Args[2:] {
		b, err := os.ReadFile(f)
		if err == nil {
			var s chart.Series
			if err = json.Unmarshal(b, &s); err == nil {
				s.Name = strings.Replace(s.Name, ", --scope-cache-max-size=10", "", 1) // the caption says it
				c.Series = append(c.Series, s)
			}
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "chart: %s: %v\n", f, err)
			os.Exit(1)
		}
	}
	fmt.Print(c.SVG())
}
