package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// The proxy subcommand at small scale: a new transport per request costs the
// member one connection per request, the pool at most one per worker. Each
// run's load, front and members are processes of their own, which served
// that run's requests alone.
func TestProxyModes(t *testing.T) {
	var out, errb bytes.Buffer
	args := []string{"proxy", "--json", "--progress=false", "--members", "2", "--workers", "10", "--requests", "4", "--repeat", "1",
		"--modes", "new-transport,new-transport-keepalive-off,sharedtransport"}
	if err := run(context.Background(), args, &out, &errb); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, errb.String())
	}
	var rep proxyReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, out.String())
	}
	if len(rep.Runs) != 3 || len(rep.Modes) != 3 {
		t.Fatalf("got %d runs, %d modes; want 3", len(rep.Runs), len(rep.Modes))
	}
	pids := map[int]string{os.Getpid(): "the test's"}
	for _, m := range rep.Runs {
		for _, p := range []struct {
			what string
			pid  int
		}{{"load", m.LoadPID}, {"front", m.FrontPID}, {"members", m.MembersPID}} {
			if p.pid <= 0 {
				t.Errorf("%s: no %s PID", m.Mode, p.what)
			} else if other, ok := pids[p.pid]; ok {
				t.Errorf("%s: %s PID %d is also %s", m.Mode, p.what, p.pid, other)
			}
			pids[p.pid] = fmt.Sprintf("%s's %s", m.Mode, p.what)
		}
		if m.Requests != 40 || m.Errors != 0 || len(m.Members) != 2 || m.FrontProcessRequests != 40 || m.MembersProcessRequests != 40 {
			t.Errorf("%s: %d requests, %d errors (%s), %d members, front served %d, members served %d; want 40, 0, 2, 40, 40",
				m.Mode, m.Requests, m.Errors, m.FirstError, len(m.Members), m.FrontProcessRequests, m.MembersProcessRequests)
			continue
		}
		if m.FrontCPUSeconds <= 0 || m.MembersCPUSeconds <= 0 || m.FrontMaxRSSBytes <= 0 {
			t.Errorf("%s: front CPU %v s, members CPU %v s, front max RSS %d; want all measured", m.Mode, m.FrontCPUSeconds, m.MembersCPUSeconds, m.FrontMaxRSSBytes)
		}
		for _, mr := range m.Members {
			switch m.Mode {
			case "sharedtransport":
				// One transport per member: net/http dials for each
				// worker waiting on the cold start at most.
				if mr.Accepted > 10 {
					t.Errorf("%s: %s accepted %d connections, want at most 10, one per worker", m.Mode, mr.Name, mr.Accepted)
				}
			default:
				if mr.Accepted != uint64(mr.Requests) {
					t.Errorf("%s: %s accepted %d connections for %d requests, want one each", m.Mode, mr.Name, mr.Accepted, mr.Requests)
				}
			}
		}
	}
	if p := rep.Runs[2].Pool; p == nil || p.Identities != 2 || p.Hits+p.Misses != 40 {
		t.Errorf("sharedtransport pool stats %+v, want 2 identities and 40 TransportFor calls", p)
	}

	out.Reset()
	if err := run(context.Background(), []string{"proxy", "--members", "1", "--workers", "2", "--requests", "1", "--repeat", "2", "--modes", "sharedtransport"}, &out, &errb); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"member-1 conns", "sharedtransport", "front CPU µs/req", "members CPU µs/req", "front max RSS MiB", "client certificate"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	if !strings.Contains(errb.String(), "round 2/2 sharedtransport") {
		t.Errorf("no progress on stderr: %q", errb.String())
	}
	for _, args := range [][]string{{"proxy", "--modes", "nope"}, {"proxy", "--repeat", "0"}} {
		if err := run(context.Background(), args, &out, &errb); err == nil || !strings.Contains(err.Error(), "usage") {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// member-3 is behind a CONNECT proxy that answers 407 without the front's
// Proxy-Authorization header, which the front sets as Karmada does (a
// WrapTransport that clones the transport below it). In every mode the
// proxy refuses nothing and opens exactly the connections member-3 accepts.
// In the pool modes the pool's own view of each member, from the front's
// process, and the scrape of its collector equal what the member servers
// counted: dials = connections accepted (= tunnels for member-3), full and
// resumed handshakes alike.
func TestProxyPoolView(t *testing.T) {
	var out, errb bytes.Buffer
	modes := []string{"new-transport", "sharedtransport", "sharedtransport-keepalive-off"}
	args := []string{"proxy", "--json", "--progress=false", "--scrape", "--members", "3", "--workers", "10", "--requests", "6", "--repeat", "1",
		"--modes", strings.Join(modes, ",")}
	if err := run(context.Background(), args, &out, &errb); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, errb.String())
	}
	var rep proxyReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, out.String())
	}
	if len(rep.Runs) != len(modes) {
		t.Fatalf("got %d runs, want %d", len(rep.Runs), len(modes))
	}
	for _, r := range rep.Runs {
		if r.Requests != 60 || r.Errors != 0 || len(r.Members) != 3 {
			t.Errorf("%s: %d requests, %d errors (%s), %d members; want 60, 0, 3", r.Mode, r.Requests, r.Errors, r.FirstError, len(r.Members))
			continue
		}
		m3 := r.Members[2]
		if cp := r.ConnectProxy; cp == nil || m3.ProxyTunnels == nil || r.Members[0].ProxyTunnels != nil || r.Members[1].ProxyTunnels != nil {
			t.Errorf("%s: proxy %+v, tunnels per member %v %v %v; want member-3 alone behind the proxy", r.Mode, cp,
				r.Members[0].ProxyTunnels, r.Members[1].ProxyTunnels, m3.ProxyTunnels)
			continue
		}
		if cp := r.ConnectProxy; cp.Rejected != 0 || cp.Tunnels != *m3.ProxyTunnels || *m3.ProxyTunnels != m3.Accepted || m3.Accepted == 0 {
			t.Errorf("%s: proxy %+v, %d tunnels to member-3, which accepted %d; want 0 refused and a tunnel per accepted connection",
				r.Mode, cp, *m3.ProxyTunnels, m3.Accepted)
		}
		if r.Mode == "new-transport" {
			if m3.Accepted != uint64(m3.Requests) || r.PoolView != nil || r.Scrape != "" {
				t.Errorf("new-transport: member-3 accepted %d for %d requests, pool view %v, scrape %d bytes; want one per request and no pool",
					m3.Accepted, m3.Requests, r.PoolView, len(r.Scrape))
			}
			continue
		}
		checkPoolView(t, r)
	}
	for _, s := range rep.Modes {
		if s.Mode != "new-transport" && (s.PoolViewRuns != 1 || s.PoolViewAgrees != 1) {
			t.Errorf("%s: pool view agrees in %d of %d runs, want 1 of 1", s.Mode, s.PoolViewAgrees, s.PoolViewRuns)
		}
	}

	// The table shows the same, from the same report.
	var table bytes.Buffer
	rep.writeTable(&table)
	for _, want := range []string{"proxy tunnels", "proxy 407s", "through a CONNECT proxy that requires Proxy-Authorization",
		"The pool's own view", "member accepted", "sharedtransport-keepalive-off 1 of 1",
		"Scrape of the pool's collector (metrics/prometheus), sharedtransport-keepalive-off", "sharedtransport_identity_dials_total{"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	if strings.Contains(table.String(), "NO") {
		t.Errorf("table has a pool view that disagrees:\n%s", table.String())
	}
	// The proxy credential is the front's secret: not in any output.
	for _, cred := range []string{proxyCredential("member-3"), strings.TrimPrefix(proxyCredential("member-3"), "Basic ")} {
		if strings.Contains(out.String()+table.String()+errb.String(), cred) {
			t.Errorf("the output holds member-3's proxy credential %q", cred)
		}
	}
}

// checkPoolView compares a pool mode's pool view and scrape with the member
// servers' and the proxy's counts.
func checkPoolView(t *testing.T, r *proxyRun) {
	t.Helper()
	if len(r.PoolView) != len(r.Members) {
		t.Errorf("%s: pool view %+v, want one row per member", r.Mode, r.PoolView)
		return
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(r.Scrape))
	if err != nil {
		t.Errorf("%s: scrape does not parse: %v\n%s", r.Mode, err, r.Scrape)
		return
	}
	scraped := func(name, identity, kind string) (float64, bool) {
		for _, m := range families[name].GetMetric() {
			var id, k string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "identity":
					id = l.GetValue()
				case "kind":
					k = l.GetValue()
				}
			}
			if id == identity && k == kind {
				return m.GetCounter().GetValue() + m.GetGauge().GetValue(), true
			}
		}
		return 0, false
	}
	var dials float64
	for i, p := range r.PoolView {
		m := r.Members[i]
		if p.Member != m.Name || p.Identity == "" || p.Host != m.URL {
			t.Errorf("%s: row %d is %+v, want %s's identity at %s", r.Mode, i, p, m.Name, m.URL)
			continue
		}
		if p.PoolDials != m.Accepted || p.PoolFull != m.Full || p.PoolResumed != m.Resumed || !p.Agrees {
			t.Errorf("%s %s: pool %d dials, %d full, %d resumed; the member accepted %d, %d full, %d resumed (agrees: %v)",
				r.Mode, m.Name, p.PoolDials, p.PoolFull, p.PoolResumed, m.Accepted, m.Full, m.Resumed, p.Agrees)
		}
		if r.Mode != "sharedtransport-keepalive-off" && (m.Accepted > 10 || p.PoolOpen != m.OpenAtEnd) {
			t.Errorf("%s %s: %d accepted, pool %d open, member %d open; want at most 10 (one per worker), the same open", r.Mode, m.Name, m.Accepted, p.PoolOpen, m.OpenAtEnd)
		}
		if behindProxy(i) {
			if p.Proxy != m.ProxyURL || m.ProxyURL == "" || p.ProxyTunnels == nil || *p.ProxyTunnels != p.PoolDials {
				t.Errorf("%s %s: pool proxy %q, tunnels %v, dials %d; want the proxy and a tunnel per dial", r.Mode, m.Name, p.Proxy, p.ProxyTunnels, p.PoolDials)
			}
		} else if p.Proxy != "" {
			t.Errorf("%s %s: pool proxy %q, want none", r.Mode, m.Name, p.Proxy)
		}
		for _, c := range []struct {
			name, kind string
			want       uint64
		}{
			{"sharedtransport_identity_dials_total", "", m.Accepted},
			{"sharedtransport_identity_handshakes_total", "full", m.Full},
			{"sharedtransport_identity_handshakes_total", "resumed", m.Resumed},
		} {
			if v, ok := scraped(c.name, p.Identity, c.kind); !ok || v != float64(c.want) {
				t.Errorf("%s %s: scraped %s{identity=%q,kind=%q} = %v (found %v), the member counted %d", r.Mode, m.Name, c.name, p.Identity, c.kind, v, ok, c.want)
			}
		}
		dials += float64(m.Accepted)
	}
	if v, ok := scraped("sharedtransport_dials_total", "", ""); !ok || v != dials {
		t.Errorf("%s: scraped sharedtransport_dials_total %v, the members accepted %v", r.Mode, v, dials)
	}
}
