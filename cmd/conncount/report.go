package main

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

type report struct {
	Target   string            `json:"target"`
	Sources  map[string]string `json:"sources"`
	Workers  int               `json:"workers"`
	Requests int               `json:"requests_per_worker"`
	Resource string            `json:"resource"`
	Started  string            `json:"started"`
	Modes    []*modeResult     `json:"modes"`
}

func (r *report) computeRatios() {
	var base *modeResult
	for _, m := range r.Modes {
		if m.Mode == "client-go" {
			base = m
		}
	}
	if base == nil {
		return
	}
	div := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return math.Round(a/b*1000) / 1000
	}
	for _, m := range r.Modes {
		m.VsClientGo = &ratios{
			Connections:       div(float64(m.Accepted), float64(base.Accepted)),
			RequestsPerSecond: div(m.RequestsPerSecond, base.RequestsPerSecond),
			CPUPerRequest:     div(m.CPUPerRequestUs, base.CPUPerRequestUs),
		}
	}
}

func (r *report) writeJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func (r *report) writeTable(w io.Writer) {
	fmt.Fprintf(w, "conncount: %d workers x %d requests, list %s, a fresh rest.Config and clientset per request\n",
		r.Workers, r.Requests, r.Resource)
	fmt.Fprintf(w, "target: %s\n\n", r.Target)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	width := 0
	for _, m := range r.Modes {
		width = max(width, len(m.Mode))
	}
	fmt.Fprintf(tw, "%-*s\t", width, "mode")
	fmt.Fprintln(tw, "requests\terrors\tconns accepted\tpeak open\topen at end\tfull TLS hs\tresumed\treq/s\tp50 ms\tp99 ms\tCPU s\tvs client-go: conns\treq/s\tCPU/req\t")
	for _, m := range r.Modes {
		ratio := "\t\t"
		if m.VsClientGo != nil {
			ratio = fmt.Sprintf("%.3gx\t%.3gx\t%.3gx", m.VsClientGo.Connections, m.VsClientGo.RequestsPerSecond, m.VsClientGo.CPUPerRequest)
		}
		hs := func(v int64) string {
			s := fmt.Sprint(v)
			if m.HandshakeSource != "server" {
				s += "*"
			}
			return s
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%.0f\t%.2f\t%.2f\t%.2f\t%s\t\n",
			fmt.Sprintf("%-*s", width, m.Mode), m.Requests, m.Errors, m.Accepted, m.PeakOpen, m.OpenAtEnd, hs(m.FullHandshakes), hs(m.Resumed),
			m.RequestsPerSecond, m.P50ms, m.P99ms, m.CPUSeconds, ratio)
	}
	tw.Flush()
	fmt.Fprintln(w)
	// Where the numbers come from; columns with the same source share a line.
	var order []string
	cols := map[string][]string{}
	for _, k := range []struct{ key, col string }{
		{"accepted", "conns accepted"}, {"peak_open", "peak open"}, {"open_end", "open at end"},
		{"handshakes", "TLS handshakes"}, {"cpu", "CPU s"}, {"latency", "p50/p99"},
	} {
		s := r.Sources[k.key]
		if s == "" {
			continue
		}
		if _, ok := cols[s]; !ok {
			order = append(order, s)
		}
		cols[s] = append(cols[s], k.col)
	}
	for _, s := range order {
		fmt.Fprintf(w, "%s: %s\n", strings.Join(cols[s], ", "), s)
	}
	for _, m := range r.Modes {
		if m.HandshakeSource != "server" {
			fmt.Fprintf(w, "* %s: handshakes from %s\n", m.Mode, m.HandshakeSource)
		}
	}
	for _, m := range r.Modes {
		if m.FirstError != "" {
			fmt.Fprintf(w, "%s: %d errors, first: %s\n", m.Mode, m.Errors, m.FirstError)
		}
	}
}

var svgColors = []string{"#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#1f77b4", "#8c564b", "#e377c2"}

// svg draws open connections over time, one line per mode, all modes on one
// time axis starting at each mode's start.
func (r *report) svg() string {
	const (
		width, height = 960, 480
		left, right   = 70, 300
		top, bottom   = 50, 50
	)
	pw, ph := float64(width-left-right), float64(height-top-bottom)
	maxT, maxOpen := 0.0, 1
	for _, m := range r.Modes {
		if m.Seconds > maxT {
			maxT = m.Seconds
		}
		for _, s := range m.Samples {
			if s.Open > maxOpen {
				maxOpen = s.Open
			}
			if s.T > maxT {
				maxT = s.T
			}
		}
		if int(m.PeakOpen) > maxOpen {
			maxOpen = int(m.PeakOpen)
		}
	}
	if maxT == 0 {
		maxT = 1
	}
	yMax := niceCeil(float64(maxOpen))
	xMax := niceCeil(maxT)
	x := func(t float64) float64 { return float64(left) + t/xMax*pw }
	y := func(v float64) float64 { return float64(top) + ph - v/yMax*ph }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="15">Open TCP connections to the API server over time (%d workers x %d requests, list %s)</text>`+"\n",
		left, r.Workers, r.Requests, html.EscapeString(r.Resource))
	// Axes and grid.
	for i := 0; i <= 5; i++ {
		v := yMax * float64(i) / 5
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, y(v), float64(left)+pw, y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, y(v)+4, trimFloat(v))
		tv := xMax * float64(i) / 5
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", x(tv), top, x(tv), float64(top)+ph)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%ss</text>`+"\n", x(tv), float64(top)+ph+18, trimFloat(tv))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.0f" height="%.0f" fill="none" stroke="#333"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">seconds since the mode started</text>`+"\n", float64(left)+pw/2, height-10)
	fmt.Fprintf(&b, `<text transform="translate(18 %.1f) rotate(-90)" text-anchor="middle">open connections</text>`+"\n", float64(top)+ph/2)
	for i, m := range r.Modes {
		color := svgColors[i%len(svgColors)]
		var pts []string
		pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(0), y(0)))
		for _, s := range m.Samples {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(s.T), y(float64(s.Open))))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, strings.Join(pts, " "))
		ly := top + 10 + i*36
		lx := width - right + 20
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", lx, ly, lx+24, ly, color)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", lx+30, ly+4, html.EscapeString(m.Mode))
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555" font-size="11">accepted %d, peak %d, %.0f req/s</text>`+"\n",
			lx+30, ly+18, m.Accepted, m.PeakOpen, m.RequestsPerSecond)
	}
	b.WriteString("</svg>\n")
	return b.String()
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
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return s
}
