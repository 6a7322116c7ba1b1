// Package chart draws open connections over time as an SVG line chart whose
// axis reads at both ends of the scale: one connection stands apart from
// none as clearly as 2,000 from 200.
//
// cmd/conncount draws the seed's load with it (docs/seed-load.svg), and
// karmada/ draws Karmada's own ConnectCluster, as is and patched.
package chart

import (
	"fmt"
	"html"
	"math"
	"os/exec"
	"sort"
	"strings"
)

// A Point is the number of connections open T seconds after a run began.
type Point struct {
	T    float64 `json:"t"`
	Open int     `json:"open"`
}

// A Series is one run's line.
type Series struct {
	Name   string  `json:"name"`
	Points []Point `json:"points"`
	// End is the label printed after the name at the end of the line: the
	// run's counts, such as "2000 accepted, peak 1950".
	End string `json:"end"`
}

// A Chart is the lines of several runs on one time axis.
type Chart struct {
	Title   string
	Caption string // the run's size and commit, under the plot
	Series  []Series
}

// colors are the lines' colors, in the order of the series.
var colors = []string{"#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c", "#8c564b", "#e377c2", "#7f7f7f"}

const (
	width, height = 1000, 500
	left, right   = 70, 360
	top, bottom   = 50, 80
	plotW, plotH  = width - left - right, height - top - bottom
	labelGap      = 15 // the least vertical distance between two end labels
	xTicks        = 5
)

// SVG renders c. The vertical axis is logarithmic with 0 a decade below 1
// (0, 1, 10, 100, ... evenly spaced), so one connection stands as clearly
// above none as 1,000 above 100.
func (c Chart) SVG() string {
	maxT, maxOpen := 0.0, 1
	for _, s := range c.Series {
		for _, p := range s.Points {
			maxT = math.Max(maxT, p.T)
			maxOpen = max(maxOpen, p.Open)
		}
	}
	top10 := 10 // the axis reaches at least 10, and a decade above the peak
	for top10 <= maxOpen {
		top10 *= 10
	}
	xMax := niceCeil(maxT)
	x := func(t float64) float64 { return left + t/xMax*plotW }
	y := func(open int) float64 { return top + plotH - decadesUp(open)/decadesUp(top10)*plotH }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="26" font-size="15">%s</text>`+"\n", left, html.EscapeString(c.Title))

	ticks := []int{0}
	for v := 1; v <= top10; v *= 10 {
		ticks = append(ticks, v)
	}
	for _, v := range ticks {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", left, y(v), left+plotW, y(v))
		fmt.Fprintf(&b, `<text class="y-tick" x="%d" y="%.1f" text-anchor="end">%d</text>`+"\n", left-6, y(v)+4, v)
	}
	for i := 0; i <= xTicks; i++ {
		t := xMax * float64(i) / xTicks
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", x(t), top, x(t), top+plotH)
		fmt.Fprintf(&b, `<text class="x-tick" x="%.1f" y="%d" text-anchor="middle">%s s</text>`+"\n", x(t), top+plotH+18, trimFloat(t))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>`+"\n", left, top, plotW, plotH)
	fmt.Fprintf(&b, `<text class="x-axis" x="%d" y="%d" text-anchor="middle">seconds since the run began</text>`+"\n", left+plotW/2, top+plotH+38)
	fmt.Fprintf(&b, `<text class="y-axis" transform="translate(20 %d) rotate(-90)" text-anchor="middle">open connections (log scale)</text>`+"\n", top+plotH/2)
	fmt.Fprintf(&b, `<text class="caption" x="%d" y="%d" fill="#555">%s</text>`+"\n", left, height-14, html.EscapeString(c.Caption))

	ends := make([]float64, len(c.Series))
	for i, s := range c.Series {
		color := colors[i%len(colors)]
		pts := []string{fmt.Sprintf("%.1f,%.1f", x(0), y(0))}
		last := Point{}
		for _, p := range s.Points {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(p.T), y(p.Open)))
			last = p
		}
		fmt.Fprintf(&b, `<polyline class="series" data-name="%s" fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n",
			html.EscapeString(s.Name), color, strings.Join(pts, " "))
		ends[i] = y(last.Open)
		// A run that ended early leads to its label dotted.
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-dasharray="2 4"/>`+"\n", x(last.T), ends[i], left+plotW, ends[i], color)
	}
	labels := spread(ends)
	for i, s := range c.Series {
		color := colors[i%len(colors)]
		lx := float64(left + plotW + 8)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", left+plotW, ends[i], lx, labels[i], color)
		fmt.Fprintf(&b, `<text class="end" data-name="%s" x="%.1f" y="%.1f" fill="%s"><tspan font-weight="bold">%s</tspan>: %s</text>`+"\n",
			html.EscapeString(s.Name), lx+4, labels[i]+4, color, html.EscapeString(s.Name), html.EscapeString(s.End))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// decadesUp is where a count sits on the vertical axis, in decades above 0.
func decadesUp(open int) float64 {
	if open <= 0 {
		return 0
	}
	return 1 + math.Log10(float64(open))
}

// spread returns the heights of the end labels: each at its line's end,
// moved apart where two would overlap, within the plot.
func spread(ends []float64) []float64 {
	order := make([]int, len(ends))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return ends[order[a]] < ends[order[b]] })
	out := make([]float64, len(ends))
	for k, i := range order {
		out[i] = ends[i]
		if k > 0 && out[i] < out[order[k-1]]+labelGap {
			out[i] = out[order[k-1]] + labelGap
		}
	}
	// Labels pushed below the plot move up together.
	if n := len(order); n > 0 {
		if over := out[order[n-1]] - float64(top+plotH); over > 0 {
			for _, i := range order {
				out[i] -= over
			}
		}
	}
	return out
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.2f", v), "0"), ".")
}

// Commit names the checkout the working directory is in, for a caption:
// "commit abc1234", with "+ changes" when tracked files differ from it.
func Commit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "commit unknown"
	}
	c := "commit " + strings.TrimSpace(string(out))
	if diff, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(diff) > 0 {
		c += " + changes"
	}
	return c
}
