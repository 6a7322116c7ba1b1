package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
)

// The proxy subcommand at small scale: a new transport per request costs the
// member one connection per request, the pool at most two per member.
func TestProxyModes(t *testing.T) {
	var out, errb bytes.Buffer
	args := []string{"proxy", "--json", "--members", "2", "--workers", "10", "--requests", "4",
		"--modes", "new-transport,new-transport-keepalive-off,sharedtransport"}
	if err := run(context.Background(), args, &out, &errb); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, errb.String())
	}
	var rep proxyReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, out.String())
	}
	if len(rep.Modes) != 3 {
		t.Fatalf("got %d modes, want 3", len(rep.Modes))
	}
	for _, m := range rep.Modes {
		if m.Requests != 40 || m.Errors != 0 || len(m.Members) != 2 {
			t.Errorf("%s: %d requests, %d errors (%s), %d members; want 40, 0, 2", m.Mode, m.Requests, m.Errors, m.FirstError, len(m.Members))
			continue
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
	if p := rep.Modes[2].Pool; p == nil || p.Identities != 2 {
		t.Errorf("sharedtransport pool stats %+v, want 2 identities", p)
	}

	out.Reset()
	if err := run(context.Background(), []string{"proxy", "--members", "1", "--workers", "2", "--requests", "1", "--modes", "sharedtransport"}, &out, &errb); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"member-1 conns", "sharedtransport", "client certificate"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	if err := run(context.Background(), []string{"proxy", "--modes", "nope"}, &out, &errb); err == nil || !strings.Contains(err.Error(), "unknown mode") {
		t.Errorf("unknown mode: %v", err)
	}
}
