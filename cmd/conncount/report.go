package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/sharedtransport/sharedtransport/internal/chart"
)

type report struct {
	Target   string            `json:"target"`
	Sources  map[string]string `json:"sources"`
	Workers  int               `json:"workers"`
	Requests int               `json:"requests_per_worker"`
	Resource string            `json:"resource"`
	Repeat   int               `json:"repeat"`
	Started  string            `json:"started"`
	// Modes summarizes the runs of each mode, in the order of --modes.
	Modes []*modeSummary `json:"modes"`
	// Runs has every run, in the order they ran.
	Runs []*modeRun `json:"runs"`
}

// figure is one number over a mode's runs.
type figure struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

func figureOf(vs []float64) figure {
	if len(vs) == 0 {
		return figure{}
	}
	s := slices.Sorted(slices.Values(vs))
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return figure{Median: m, Min: s[0], Max: s[len(s)-1]}
}

// ratio compares a mode with client-go: the ratio of the two medians, and
// the lowest and highest ratio of the two within one round.
type ratio struct {
	OfMedians float64 `json:"of_medians"`
	Min       float64 `json:"min"`
	Max       float64 `json:"max"`
}

type ratios struct {
	Connections         ratio  `json:"connections"`
	RequestsPerSecond   ratio  `json:"requests_per_second"`
	CPUPerRequest       ratio  `json:"cpu_per_request"`
	ServerCPUPerRequest *ratio `json:"server_cpu_per_request,omitempty"`
	MaxRSS              ratio  `json:"max_rss"`
}

type modeSummary struct {
	Mode                  string  `json:"mode"`
	Description           string  `json:"description"`
	Runs                  int     `json:"runs"`
	Requests              figure  `json:"requests"`
	Errors                int64   `json:"errors"` // over all runs
	FirstError            string  `json:"first_error,omitempty"`
	Accepted              figure  `json:"connections_accepted"`
	PeakOpen              figure  `json:"peak_open"`
	OpenAtEnd             figure  `json:"open_at_end"`
	FullHandshakes        figure  `json:"full_handshakes"`
	Resumed               figure  `json:"resumed_handshakes"`
	HandshakeSource       string  `json:"handshake_source"`
	RequestsPerSecond     figure  `json:"requests_per_second"`
	P50ms                 figure  `json:"p50_ms"`
	P99ms                 figure  `json:"p99_ms"`
	CPUPerRequestUs       figure  `json:"cpu_per_request_us"`
	ServerCPUPerRequestUs *figure `json:"server_cpu_per_request_us,omitempty"`
	PeakHeapMiB           figure  `json:"peak_heap_mib"`
	MaxRSSMiB             figure  `json:"max_rss_mib"`
	VsClientGo            *ratios `json:"vs_client_go,omitempty"`
}

const mib = 1 << 20

// runMetric reads one number of a run; ok is false when the run has none.
type runMetric func(r *modeRun) (v float64, ok bool)

func always(f func(r *modeRun) float64) runMetric {
	return func(r *modeRun) (float64, bool) { return f(r), true }
}

var (
	metricAccepted  = always(func(r *modeRun) float64 { return float64(r.Accepted) })
	metricRPS       = always(func(r *modeRun) float64 { return r.RequestsPerSecond })
	metricCPU       = always(func(r *modeRun) float64 { return r.CPUPerRequestUs })
	metricMaxRSS    = always(func(r *modeRun) float64 { return float64(r.MaxRSSBytes) / mib })
	metricServerCPU = func(r *modeRun) (float64, bool) {
		if r.ServerCPUPerRequestUs == nil {
			return 0, false
		}
		return *r.ServerCPUPerRequestUs, true
	}
)

// collect returns the metric's value for each of runs that has one.
func collect(runs []*modeRun, m runMetric) []float64 {
	var vs []float64
	for _, r := range runs {
		if v, ok := m(r); ok {
			vs = append(vs, v)
		}
	}
	return vs
}

// summarize fills r.Modes from r.Runs, for modes in this order.
func (r *report) summarize(modes []string) {
	byMode := map[string][]*modeRun{}
	for _, run := range r.Runs {
		byMode[run.Mode] = append(byMode[run.Mode], run)
	}
	r.Modes = nil
	for _, name := range modes {
		runs := byMode[name]
		s := &modeSummary{Mode: name, Runs: len(runs)}
		if def := findMode(name); def != nil {
			s.Description = def.desc
		}
		fig := func(m runMetric) figure { return figureOf(collect(runs, m)) }
		count := func(f func(r *modeRun) int64) figure {
			return fig(always(func(r *modeRun) float64 { return float64(f(r)) }))
		}
		s.Requests = count(func(r *modeRun) int64 { return r.Requests })
		s.Accepted = fig(metricAccepted)
		s.PeakOpen = count(func(r *modeRun) int64 { return r.PeakOpen })
		s.OpenAtEnd = count(func(r *modeRun) int64 { return r.OpenAtEnd })
		s.FullHandshakes = count(func(r *modeRun) int64 { return r.FullHandshakes })
		s.Resumed = count(func(r *modeRun) int64 { return r.Resumed })
		s.RequestsPerSecond = fig(metricRPS)
		s.P50ms = fig(always(func(r *modeRun) float64 { return r.P50ms }))
		s.P99ms = fig(always(func(r *modeRun) float64 { return r.P99ms }))
		s.CPUPerRequestUs = fig(metricCPU)
		if vs := collect(runs, metricServerCPU); len(vs) > 0 {
			f := figureOf(vs)
			s.ServerCPUPerRequestUs = &f
		}
		s.PeakHeapMiB = fig(always(func(r *modeRun) float64 { return float64(r.PeakHeapBytes) / mib }))
		s.MaxRSSMiB = fig(metricMaxRSS)
		for _, run := range runs {
			s.Errors += run.Errors
			if s.FirstError == "" {
				s.FirstError = run.FirstError
			}
			if s.HandshakeSource == "" || run.HandshakeSource != "server" {
				s.HandshakeSource = run.HandshakeSource
			}
		}
		r.Modes = append(r.Modes, s)
	}
	base := byMode["client-go"]
	if len(base) == 0 {
		return
	}
	for _, s := range r.Modes {
		runs := byMode[s.Mode]
		s.VsClientGo = &ratios{
			Connections:       ratioOf(runs, base, metricAccepted),
			RequestsPerSecond: ratioOf(runs, base, metricRPS),
			CPUPerRequest:     ratioOf(runs, base, metricCPU),
			MaxRSS:            ratioOf(runs, base, metricMaxRSS),
		}
		if len(collect(runs, metricServerCPU)) > 0 && len(collect(base, metricServerCPU)) > 0 {
			sc := ratioOf(runs, base, metricServerCPU)
			s.VsClientGo.ServerCPUPerRequest = &sc
		}
	}
}

// ratioOf compares runs with base: the ratio of their medians, and the range
// of the ratios of runs and base in the same round.
func ratioOf(runs, base []*modeRun, m runMetric) ratio {
	div := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return a / b
	}
	out := ratio{OfMedians: div(figureOf(collect(runs, m)).Median, figureOf(collect(base, m)).Median)}
	first := true
	for _, r := range runs {
		for _, b := range base {
			if b.Round != r.Round {
				continue
			}
			v, ok1 := m(r)
			bv, ok2 := m(b)
			if !ok1 || !ok2 || bv == 0 {
				continue
			}
			q := v / bv
			if first {
				out.Min, out.Max, first = q, q, false
			}
			out.Min, out.Max = min(out.Min, q), max(out.Max, q)
		}
	}
	return out
}

func (r *report) writeJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// num formats a number with about three significant digits (integers
// whole), and no exponent for the sizes shown here.
func num(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100 || v == math.Trunc(v):
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case a >= 1:
		return strings.TrimSuffix(strings.TrimRight(strconv.FormatFloat(v, 'f', 2, 64), "0"), ".")
	default:
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
}

// String is the median, and the range when the runs differ.
func (f figure) String() string {
	if num(f.Min) == num(f.Max) {
		return num(f.Median)
	}
	return fmt.Sprintf("%s [%s-%s]", num(f.Median), num(f.Min), num(f.Max))
}

func (q ratio) String() string {
	if num(q.Min) == num(q.Max) {
		return num(q.OfMedians) + "x"
	}
	return fmt.Sprintf("%sx [%s-%s]", num(q.OfMedians), num(q.Min), num(q.Max))
}

// table writes rows under header, the first column left-aligned.
func table(w io.Writer, header []string, rows [][]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	width := 0
	for _, row := range append([][]string{header}, rows...) {
		width = max(width, len(row[0]))
	}
	for _, row := range append([][]string{header}, rows...) {
		fmt.Fprintf(tw, "%-*s\t%s\t\n", width, row[0], strings.Join(row[1:], "\t"))
	}
	tw.Flush()
}

func (r *report) writeTable(w io.Writer) {
	fmt.Fprintf(w, "conncount: %d workers x %d requests, list %s, a fresh rest.Config and clientset per request\n",
		r.Workers, r.Requests, r.Resource)
	fmt.Fprintf(w, "target: %s\n", r.Target)
	fmt.Fprintf(w, "%d round(s), every run of a mode in a fresh client process; round r starts at the r-th mode of --modes\n", r.Repeat)
	if r.Repeat > 1 {
		fmt.Fprintf(w, "each figure: median [min-max] of the %d runs\n", r.Repeat)
	}

	fmt.Fprintln(w, "\nConnections")
	var rows [][]string
	for _, m := range r.Modes {
		hs := func(f figure) string {
			if m.HandshakeSource != "server" {
				return f.String() + "*"
			}
			return f.String()
		}
		rows = append(rows, []string{m.Mode, m.Requests.String(), fmt.Sprint(m.Errors), m.Accepted.String(), m.PeakOpen.String(),
			m.OpenAtEnd.String(), hs(m.FullHandshakes), hs(m.Resumed)})
	}
	table(w, []string{"mode", "requests", "errors", "conns accepted", "peak open", "open at end", "full TLS hs", "resumed"}, rows)

	fmt.Fprintln(w, "\nCost")
	rows = nil
	for _, m := range r.Modes {
		server := "n/a"
		if m.ServerCPUPerRequestUs != nil {
			server = m.ServerCPUPerRequestUs.String()
		}
		rows = append(rows, []string{m.Mode, m.RequestsPerSecond.String(), m.P50ms.String(), m.P99ms.String(),
			m.CPUPerRequestUs.String(), server, m.PeakHeapMiB.String(), m.MaxRSSMiB.String()})
	}
	table(w, []string{"mode", "req/s", "p50 ms", "p99 ms", "client CPU µs/req", "server CPU µs/req", "client peak heap MiB", "client max RSS MiB"}, rows)

	if len(r.Modes) > 0 && r.Modes[0].VsClientGo != nil {
		fmt.Fprintln(w, "\nvs client-go: ratio of the medians [lowest-highest ratio within one round]")
		rows = nil
		for _, m := range r.Modes {
			v := m.VsClientGo
			server := "n/a"
			if v.ServerCPUPerRequest != nil {
				server = v.ServerCPUPerRequest.String()
			}
			rows = append(rows, []string{m.Mode, v.Connections.String(), v.RequestsPerSecond.String(), v.CPUPerRequest.String(), server, v.MaxRSS.String()})
		}
		table(w, []string{"mode", "conns", "req/s", "client CPU/req", "server CPU/req", "client max RSS"}, rows)
	}
	fmt.Fprintln(w)
	r.writeSources(w)
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

// writeSources says where the numbers come from; columns with the same
// source share a line.
func (r *report) writeSources(w io.Writer) {
	var order []string
	cols := map[string][]string{}
	for _, k := range []struct{ key, col string }{
		{"accepted", "conns accepted"}, {"peak_open", "peak open"}, {"open_end", "open at end"},
		{"handshakes", "TLS handshakes"}, {"cpu", "client CPU"}, {"server_cpu", "server CPU"},
		{"memory", "peak heap, max RSS"}, {"latency", "p50/p99"},
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
}

// medianRuns returns, per mode, the run whose requests per second are the
// median (the lower one of an even count).
func (r *report) medianRuns() []*modeRun {
	var out []*modeRun
	for _, m := range r.Modes {
		var runs []*modeRun
		for _, run := range r.Runs {
			if run.Mode == m.Mode {
				runs = append(runs, run)
			}
		}
		if len(runs) == 0 {
			continue
		}
		slices.SortFunc(runs, func(a, b *modeRun) int { return cmp.Compare(a.RequestsPerSecond, b.RequestsPerSecond) })
		out = append(out, runs[(len(runs)-1)/2])
	}
	return out
}

// svg draws open connections over time for each mode of modes (every mode
// when empty), from its run of median requests per second, on one time
// axis.
func (r *report) svg(modes []string) string {
	runs := "one run"
	if r.Repeat > 1 {
		runs = fmt.Sprintf("the median run of %d", r.Repeat)
	}
	c := chart.Chart{
		Title: "Open TCP connections to the API server, counted by the server",
		Caption: fmt.Sprintf("%d workers x %d requests (list %s), a fresh rest.Config and clientset per request; %s per mode; %s",
			r.Workers, r.Requests, r.Resource, runs, chart.Commit()),
	}
	for _, m := range r.medianRuns() {
		if len(modes) > 0 && !slices.Contains(modes, m.Mode) {
			continue
		}
		c.Series = append(c.Series, chart.Series{Name: m.Mode, Points: m.Samples,
			End: fmt.Sprintf("%d accepted, peak %d", m.Accepted, m.PeakOpen)})
	}
	return c.SVG()
}
