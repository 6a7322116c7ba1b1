package chart

import (
	"encoding/xml"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// element is one element of the SVG, with its attributes and text.
type element struct {
	name  string
	attrs map[string]string
	text  string
}

func parse(t *testing.T, svg string) []element {
	t.Helper()
	dec := xml.NewDecoder(strings.NewReader(svg))
	var out []element
	var open []int // indexes of the elements being read
	for {
		tok, err := dec.Token()
		if err != nil {
			if err == io.EOF {
				return out
			}
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			e := element{name: tok.Name.Local, attrs: map[string]string{}}
			for _, a := range tok.Attr {
				e.attrs[a.Name.Local] = a.Value
			}
			out = append(out, e)
			open = append(open, len(out)-1)
		case xml.CharData:
			for _, i := range open {
				out[i].text += string(tok)
			}
		case xml.EndElement:
			open = open[:len(open)-1]
		}
	}
}

func withClass(es []element, name, class string) []element {
	var out []element
	for _, e := range es {
		if e.name == name && e.attrs["class"] == class {
			out = append(out, e)
		}
	}
	return out
}

// yOf returns the heights of a polyline's points.
func yOf(t *testing.T, e element) []float64 {
	var ys []float64
	for _, p := range strings.Fields(e.attrs["points"]) {
		_, y, ok := strings.Cut(p, ",")
		v, err := strconv.ParseFloat(y, 64)
		if !ok || err != nil {
			t.Fatalf("point %q of %s", p, e.attrs["data-name"])
		}
		ys = append(ys, v)
	}
	return ys
}

// The seed's chart as hack/measure.sh draws it, from a fixed run: every
// mode's line and end label with its counts, the axes' labels, the caption,
// and a scale on which the pool's one connection stands clear of zero
// while client-go's 2,000 stay inside the plot.
func TestSeedChart(t *testing.T) {
	ramp := func(peak int) []Point {
		var ps []Point
		for i := 0; i <= 20; i++ {
			ps = append(ps, Point{T: float64(i) * 0.5, Open: peak * min(i, 10) / 10})
		}
		return ps
	}
	c := Chart{
		Title:   "Open TCP connections to the API server",
		Caption: "100 workers x 20 requests; commit 0123abc",
		Series: []Series{
			{Name: "client-go", Points: ramp(2), End: "2 accepted, peak 2"},
			{Name: "client-go-proxy", Points: ramp(2000), End: "2000 accepted, peak 2000"},
			{Name: "client-go-keepalive-off", Points: ramp(100), End: "2000 accepted, peak 100"},
			{Name: "sharedtransport", Points: ramp(1), End: "1 accepted, peak 1"},
			{Name: "pool <&> \"quoted\"", Points: ramp(1), End: "1 accepted, peak 1"},
		},
	}
	es := parse(t, c.SVG())

	lines := withClass(es, "polyline", "series")
	ends := withClass(es, "text", "end")
	if len(lines) != len(c.Series) || len(ends) != len(c.Series) {
		t.Fatalf("%d lines and %d end labels for %d series", len(lines), len(ends), len(c.Series))
	}
	for i, s := range c.Series {
		if got := lines[i].attrs["data-name"]; got != s.Name {
			t.Errorf("line %d is %q, want %q", i, got, s.Name)
		}
		if n := len(yOf(t, lines[i])); n != len(s.Points)+1 {
			t.Errorf("%s: %d points drawn, want %d (the origin and every sample)", s.Name, n, len(s.Points)+1)
		}
		if want := s.Name + ": " + s.End; ends[i].text != want {
			t.Errorf("end label %q, want %q", ends[i].text, want)
		}
	}

	var yTicks, xTicks []string
	for _, e := range withClass(es, "text", "y-tick") {
		yTicks = append(yTicks, e.text)
	}
	for _, e := range withClass(es, "text", "x-tick") {
		xTicks = append(xTicks, e.text)
	}
	if want := []string{"0", "1", "10", "100", "1000", "10000"}; !slices.Equal(yTicks, want) {
		t.Errorf("vertical axis %q, want %q", yTicks, want)
	}
	if want := []string{"0 s", "2 s", "4 s", "6 s", "8 s", "10 s"}; !slices.Equal(xTicks, want) {
		t.Errorf("time axis %q, want %q", xTicks, want)
	}
	for class, want := range map[string]string{
		"x-axis":  "seconds since the run began",
		"y-axis":  "open connections (log scale)",
		"caption": c.Caption,
	} {
		if got := withClass(es, "text", class); len(got) != 1 || got[0].text != want {
			t.Errorf("%s: %v, want %q", class, got, want)
		}
	}

	zero, one, most := yOf(t, lines[3])[0], yOf(t, lines[3])[20], slices.Min(yOf(t, lines[1]))
	if zero-one < plotH/6 {
		t.Errorf("1 connection drawn %.1f px above 0, want at least %d", zero-one, plotH/6)
	}
	if most < top || most > zero-plotH*0.75 {
		t.Errorf("2000 connections drawn at %.1f, want within the top quarter of the plot (%d to %d)", most, top, top+plotH/4)
	}

	// The two lines that end at 1 get labels apart from each other.
	var labelY []float64
	for _, e := range ends {
		v, err := strconv.ParseFloat(e.attrs["y"], 64)
		if err != nil {
			t.Fatal(err)
		}
		labelY = append(labelY, v)
	}
	for i := range labelY {
		for j := range i {
			if math.Abs(labelY[i]-labelY[j]) < labelGap {
				t.Errorf("end labels %q and %q overlap (%.1f, %.1f)", ends[j].text, ends[i].text, labelY[j], labelY[i])
			}
		}
		if labelY[i] > top+plotH+4 {
			t.Errorf("end label %q below the plot (%.1f)", ends[i].text, labelY[i])
		}
	}
}

// A run that sampled nothing (a load that ended before the first tick)
// still gets its line, at 0, and its label; a chart of no run draws its
// axes.
func TestChartWithoutSamples(t *testing.T) {
	es := parse(t, Chart{Series: []Series{{Name: "empty", End: "0 accepted"}}}.SVG())
	lines, ends := withClass(es, "polyline", "series"), withClass(es, "text", "end")
	if len(lines) != 1 || len(ends) != 1 || ends[0].text != "empty: 0 accepted" {
		t.Errorf("lines %v, end labels %v", lines, ends)
	}
	if ticks := withClass(parse(t, Chart{}.SVG()), "text", "y-tick"); len(ticks) != 3 {
		t.Errorf("an empty chart's vertical axis has %d ticks, want 0, 1 and 10", len(ticks))
	}
}
