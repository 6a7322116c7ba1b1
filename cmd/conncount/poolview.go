package main

// The pool's own view in conncount proxy: what (*Pool).Identities() and the
// pool's Prometheus collector say about each member, taken in the front's
// process after the load, beside what the member servers and the CONNECT
// proxy counted over the same load.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	prom "github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sharedtransport/sharedtransport"
	stprom "github.com/sharedtransport/sharedtransport/metrics/prometheus"
)

// poolMember is one identity of the front's pool, the member it talks to,
// and what that member's server (and the CONNECT proxy in front of it)
// counted.
type poolMember struct {
	Member   string `json:"member"`
	Identity string `json:"identity"` // the pool's redacted name; "" when the pool has none for the member
	Auth     string `json:"auth"`
	Host     string `json:"host"`
	Proxy    string `json:"proxy"`

	PoolOpen    int    `json:"pool_open_connections"`
	PoolDials   uint64 `json:"pool_dials"`
	PoolFull    uint64 `json:"pool_full_handshakes"`
	PoolResumed uint64 `json:"pool_resumed_handshakes"`

	ServerAccepted uint64  `json:"server_connections_accepted"`
	ServerFull     uint64  `json:"server_full_handshakes"`
	ServerResumed  uint64  `json:"server_resumed_handshakes"`
	ServerOpen     int     `json:"server_open_at_end"`
	ProxyTunnels   *uint64 `json:"proxy_tunnels,omitempty"`

	// Agrees: for the member, the pool's dials, full and resumed handshakes
	// (summed over its identities) equal the server's accepted connections
	// and handshakes, and the proxy's tunnels when it is behind the proxy.
	// Open connections are left out: the two are read moments apart.
	Agrees bool `json:"agrees"`
}

// poolViewOf matches the pool's identities to the members by host: one row
// per identity of each member, a row with no identity for a member the pool
// never sent a request to, and a row with no member for an identity that
// talks to none of them.
func poolViewOf(ids []sharedtransport.IdentityInfo, members []memberResult) []poolMember {
	rows := []poolMember{}
	used := make([]bool, len(ids))
	for _, m := range members {
		server := poolMember{Member: m.Name, Host: m.URL, ServerAccepted: m.Accepted, ServerFull: m.Full,
			ServerResumed: m.Resumed, ServerOpen: m.OpenAtEnd, ProxyTunnels: m.ProxyTunnels}
		var mine []poolMember
		var dials, full, resumed uint64
		for i, id := range ids {
			if !slices.Contains(id.Hosts, m.URL) {
				continue
			}
			used[i] = true
			row := server
			row.Identity, row.Auth, row.Host, row.Proxy = id.Name, string(id.Auth), strings.Join(id.Hosts, ","), id.Proxy
			row.PoolOpen, row.PoolDials, row.PoolFull, row.PoolResumed = id.OpenConns, id.Dials, id.Handshakes, id.Resumptions
			dials, full, resumed = dials+id.Dials, full+id.Handshakes, resumed+id.Resumptions
			mine = append(mine, row)
		}
		if len(mine) == 0 {
			mine = append(mine, server)
		}
		agrees := dials == m.Accepted && full == m.Full && resumed == m.Resumed &&
			(m.ProxyTunnels == nil || *m.ProxyTunnels == dials)
		for i := range mine {
			mine[i].Agrees = agrees
		}
		rows = append(rows, mine...)
	}
	for i, id := range ids {
		if !used[i] {
			rows = append(rows, poolMember{Identity: id.Name, Auth: string(id.Auth), Host: strings.Join(id.Hosts, ","), Proxy: id.Proxy,
				PoolOpen: id.OpenConns, PoolDials: id.Dials, PoolFull: id.Handshakes, PoolResumed: id.Resumptions})
		}
	}
	return rows
}

func poolViewAgrees(rows []poolMember) bool {
	for _, r := range rows {
		if !r.Agrees {
			return false
		}
	}
	return true
}

// writePoolView prints the pool view of the last run of each pool mode, and
// in how many runs of the mode it agreed with the servers.
func (r *proxyReport) writePoolView(w io.Writer) {
	var rows [][]string
	var agree []string
	for _, m := range r.Modes {
		run := r.lastRun(m.Mode, func(run *proxyRun) bool { return run.PoolView != nil })
		if run == nil {
			continue
		}
		for _, p := range run.PoolView {
			tunnels := "-"
			if p.ProxyTunnels != nil {
				tunnels = fmt.Sprint(*p.ProxyTunnels)
			}
			identity, proxy := p.Identity, p.Proxy
			if identity == "" {
				identity = "(none)"
			}
			if proxy == "" {
				proxy = "(environment)" // IdentityInfo.Proxy: the config sets none
			}
			rows = append(rows, []string{m.Mode, fmt.Sprint(run.Round), p.Member, identity, p.Host, proxy,
				fmt.Sprint(p.PoolOpen), fmt.Sprint(p.PoolDials), fmt.Sprint(p.PoolFull), fmt.Sprint(p.PoolResumed),
				fmt.Sprint(p.ServerAccepted), fmt.Sprint(p.ServerFull), fmt.Sprint(p.ServerResumed), fmt.Sprint(p.ServerOpen), tunnels, yesNo(p.Agrees)})
		}
		agree = append(agree, fmt.Sprintf("%s %d of %d", m.Mode, m.PoolViewAgrees, m.PoolViewRuns))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "\nThe pool's own view ((*Pool).Identities() in the front's process after the load) beside what each member counted; last run of each pool mode")
	table(w, []string{"mode", "round", "member", "identity", "host", "proxy", "pool open", "pool dials", "pool full hs", "pool resumed",
		"member accepted", "member full hs", "member resumed", "member open", "proxy tunnels", "agree"}, rows)
	fmt.Fprintf(w, "agree: pool dials = member accepted (= proxy tunnels), pool full and resumed handshakes = the member's; runs that agree: %s\n", strings.Join(agree, ", "))
}

// writeScrapes prints the scrape of the last run of each pool mode.
func (r *proxyReport) writeScrapes(w io.Writer) {
	for _, m := range r.Modes {
		run := r.lastRun(m.Mode, func(run *proxyRun) bool { return run.Scrape != "" })
		if run == nil {
			continue
		}
		fmt.Fprintf(w, "\nScrape of the pool's collector (metrics/prometheus), %s, round %d, from the front's process after the load\n", m.Mode, run.Round)
		fmt.Fprint(w, run.Scrape)
	}
}

func (r *proxyReport) lastRun(mode string, ok func(*proxyRun) bool) *proxyRun {
	for i := len(r.Runs) - 1; i >= 0; i-- {
		if run := r.Runs[i]; run.Mode == mode && ok(run) {
			return run
		}
	}
	return nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

// serveMetrics serves pool's collector, alone in a registry of its own, at
// /metrics on a loopback port, as a program would for Prometheus.
func serveMetrics(pool *sharedtransport.Pool) (*http.Server, string, error) {
	reg := prom.NewRegistry()
	if err := reg.Register(stprom.NewCollector(pool)); err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, "http://" + ln.Addr().String() + "/metrics", nil
}

// maxScrape bounds the scrape read: a few hundred bytes per identity.
const maxScrape = 16 << 20

// scrapeMetrics GETs url in the text format Prometheus scrapes.
func scrapeMetrics(ctx context.Context, url string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("scrape the front's metrics: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxScrape+1))
	switch {
	case err != nil:
		return "", fmt.Errorf("scrape the front's metrics: %w", err)
	case resp.StatusCode != http.StatusOK:
		return "", fmt.Errorf("scrape the front's metrics: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	case len(body) > maxScrape:
		return "", errors.New("scrape the front's metrics: more than 16 MiB")
	}
	return string(body), nil
}
