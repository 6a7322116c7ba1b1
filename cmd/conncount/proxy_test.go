package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

// The proxy subcommand at small scale: a new transport per request costs the
// member one connection per request, the pool at most two per member. Each
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
				if mr.Accepted > 2 {
					t.Errorf("%s: %s accepted %d connections, want at most 2", m.Mode, mr.Name, mr.Accepted)
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
