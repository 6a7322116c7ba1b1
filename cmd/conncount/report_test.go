package main

import (
	"encoding/xml"
	"strings"
	"testing"
)

// The chart hack/measure.sh draws, from a fixed report of two rounds: a
// line for each mode --svg-modes names, drawn from its run of median
// requests per second, labelled with that run's counts; the run's size in
// the caption.
func TestChartFromReport(t *testing.T) {
	rep := &report{Workers: 100, Requests: 20, Resource: "nodes", Repeat: 2}
	add := func(mode string, reqPerSec float64, accepted, peak int64) {
		run := &modeRun{Mode: mode, Accepted: accepted, PeakOpen: peak,
			Samples: []sample{{T: 0.5, Open: int(peak)}, {T: 3, Open: int(peak) / 2}}}
		run.RequestsPerSecond = reqPerSec
		rep.Runs = append(rep.Runs, run)
	}
	add("client-go-proxy", 900, 2000, 1800) // the median run: the lower of two
	add("client-go-proxy", 1000, 1999, 1700)
	add("sharedtransport", 5000, 1, 1)
	add("sharedtransport", 4000, 2, 2)
	add("floor", 6000, 1, 1)
	rep.summarize([]string{"client-go-proxy", "sharedtransport", "floor"})

	svg := rep.svg([]string{"client-go-proxy", "sharedtransport"})
	var lines, ends, captions []string
	var classes []string // of the elements being read, innermost last
	dec := xml.NewDecoder(strings.NewReader(svg))
	for {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			class, name := "", ""
			for _, a := range tok.Attr {
				switch a.Name.Local {
				case "class":
					class = a.Value
				case "data-name":
					name = a.Value
				}
			}
			if class == "" && len(classes) > 0 {
				class = classes[len(classes)-1] // a tspan is its text's
			}
			classes = append(classes, class)
			if class == "series" {
				lines = append(lines, name)
			}
		case xml.EndElement:
			classes = classes[:len(classes)-1]
		case xml.CharData:
			if len(classes) == 0 {
				continue
			}
			switch classes[len(classes)-1] {
			case "end":
				ends = append(ends, string(tok))
			case "caption":
				captions = append(captions, string(tok))
			}
		}
	}
	if want := []string{"client-go-proxy", "sharedtransport"}; strings.Join(lines, ",") != strings.Join(want, ",") {
		t.Errorf("lines %q, want %q", lines, want)
	}
	if got, want := strings.Join(ends, ""), "client-go-proxy: 2000 accepted, peak 1800sharedtransport: 2 accepted, peak 2"; got != want {
		t.Errorf("end labels %q, want %q", got, want)
	}
	if len(captions) != 1 || !strings.HasPrefix(captions[0], "100 workers x 20 requests (list nodes)") ||
		!strings.Contains(captions[0], "the median run of 2 per mode; commit ") {
		t.Errorf("caption %q", captions)
	}
}
