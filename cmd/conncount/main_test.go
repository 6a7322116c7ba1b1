package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sharedtransport/sharedtransport/internal/nstest"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

func TestMain(m *testing.M) {
	// Every run starts this executable again as its client and server.
	if code, ok := childMain(); ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

func runJSON(t *testing.T, args ...string) *report {
	t.Helper()
	var out, errb bytes.Buffer
	args = append([]string{"--json", "--progress=false"}, args...)
	if err := run(context.Background(), args, &out, &errb); err != nil {
		t.Fatalf("run %v: %v\nstderr:\n%s", args, err, errb.String())
	}
	var rep report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("bad JSON: %v\n%s", err, out.String())
	}
	return &rep
}

func byMode(t *testing.T, rep *report) map[string]*modeRun {
	t.Helper()
	m := map[string]*modeRun{}
	for _, r := range rep.Runs {
		if m[r.Mode] != nil {
			t.Fatalf("mode %s ran more than once", r.Mode)
		}
		m[r.Mode] = r
	}
	return m
}

// Each run of a mode is measured in a client process of its own, in either
// order of --modes: every run's client and server report a PID no other
// run (nor the test) has, and the counters those processes kept over their
// whole lives hold that run's requests alone.
func TestRunsInOwnProcesses(t *testing.T) {
	const workers, requests = 4, 3
	const total = workers * requests
	for _, order := range [][]string{{"client-go", "sharedtransport"}, {"sharedtransport", "client-go"}} {
		t.Run(strings.Join(order, ","), func(t *testing.T) {
			rep := runJSON(t, "--workers", fmt.Sprint(workers), "--requests", fmt.Sprint(requests), "--repeat", "2",
				"--modes", strings.Join(order, ","))
			// Round 2 starts at the second mode.
			want := []string{order[0], order[1], order[1], order[0]}
			if len(rep.Runs) != len(want) {
				t.Fatalf("got %d runs, want %d", len(rep.Runs), len(want))
			}
			pids := map[int]string{os.Getpid(): "the test's"}
			for i, r := range rep.Runs {
				if r.Mode != want[i] || r.Seq != i+1 || r.Round != i/2+1 {
					t.Errorf("run %d: mode %s, seq %d, round %d; want %s, %d, %d", i+1, r.Mode, r.Seq, r.Round, want[i], i+1, i/2+1)
				}
				for _, p := range []struct {
					what string
					pid  int
				}{{"client", r.PID}, {"server", r.ServerPID}} {
					if p.pid <= 0 {
						t.Errorf("run %d (%s): no %s PID", i+1, r.Mode, p.what)
					} else if other, ok := pids[p.pid]; ok {
						t.Errorf("run %d (%s): %s PID %d is also %s", i+1, r.Mode, p.what, p.pid, other)
					}
					pids[p.pid] = fmt.Sprintf("run %d's %s", i+1, p.what)
				}
				if r.Requests != total || r.Errors != 0 || r.ProcessRequests != total || r.ServerProcessRequests != total {
					t.Errorf("run %d (%s): %d requests (%d errors: %s); its client process sent %d, its server served %d; want %d each",
						i+1, r.Mode, r.Requests, r.Errors, r.FirstError, r.ProcessRequests, r.ServerProcessRequests, total)
				}
				switch r.Mode {
				case "client-go":
					if r.Pool != nil {
						t.Errorf("run %d (client-go): pool stats %+v, want none", i+1, r.Pool)
					}
				case "sharedtransport":
					if p := r.Pool; p == nil || p.Hits+p.Misses != total || p.Misses != 1 || p.Identities != 1 {
						t.Errorf("run %d (sharedtransport): pool stats %+v; want %d Wraps, 1 identity built", i+1, p, total)
					}
				}
				if r.CPUSeconds <= 0 || r.MaxRSSBytes <= 0 || r.PeakHeapBytes == 0 || r.ServerCPUSeconds == nil || *r.ServerCPUSeconds <= 0 || r.ServerMaxRSSBytes <= 0 {
					t.Errorf("run %d (%s): client CPU %v s, max RSS %d, peak heap %d, server CPU %v, server max RSS %d; want all measured",
						i+1, r.Mode, r.CPUSeconds, r.MaxRSSBytes, r.PeakHeapBytes, r.ServerCPUSeconds, r.ServerMaxRSSBytes)
				}
			}
			// The summary follows --modes and takes each mode's own runs.
			for i, s := range rep.Modes {
				if s.Mode != order[i] || s.Runs != 2 || s.Requests.Median != total {
					t.Errorf("summary %d: %s, %d runs, %v requests; want %s, 2, %d", i, s.Mode, s.Runs, s.Requests, order[i], total)
				}
			}
		})
	}
}

// The seed's comparison at small scale on the embedded server (child
// process), counted by the server.
func TestEmbeddedModes(t *testing.T) {
	svg := filepath.Join(t.TempDir(), "conns.svg")
	const workers = 20
	rep := runJSON(t, "--workers", fmt.Sprint(workers), "--requests", "5", "--repeat", "1", "--svg", svg)
	const requests = workers * 5
	modes := byMode(t, rep)
	if len(modes) != len(defaultModes) {
		t.Fatalf("got %d modes, want %v", len(modes), defaultModes)
	}
	for _, r := range rep.Runs {
		if r.Requests != requests || r.Errors != 0 {
			t.Errorf("%s: %d requests, %d errors (first: %s)", r.Mode, r.Requests, r.Errors, r.FirstError)
		}
		if r.HandshakeSource != "server" {
			t.Errorf("%s: handshakes from %q, want the server", r.Mode, r.HandshakeSource)
		}
		t.Logf("%-30s accepted %4d peak %4d full %4d resumed %4d  %6.0f req/s", r.Mode, r.Accepted, r.PeakOpen, r.FullHandshakes, r.Resumed, r.RequestsPerSecond)
	}
	// Keep-alive on, one transport for every request: net/http dials for
	// each request waiting on the cold start, and none after (HTTP/2 carries
	// 100 streams; 20 workers need one): at most one connection per worker,
	// as client-go's best case ("client-go", logged above).
	// The pool's HTTPClientFor and Wrap: one identity, every config a hit
	// but the first.
	for _, mode := range []string{"sharedtransport", "sharedtransport-wrap"} {
		if st := modes[mode]; st.Accepted > workers || st.PeakOpen > workers || st.Pool == nil ||
			st.Pool.Identities != 1 || st.Pool.Misses != 1 || st.Pool.Hits != requests-1 || st.Pool.PassThrough != 0 {
			t.Errorf("%s: accepted %d, peak %d, pool %+v; want at most %d connections, 1 identity, %d hits",
				mode, st.Accepted, st.PeakOpen, st.Pool, workers, requests-1)
		}
	}
	// The measuring sticks: one client, or one round tripper, for every
	// config.
	for _, mode := range []string{"floor", "floor-wrap"} {
		if fl := modes[mode]; fl.Accepted > workers || fl.Pool == nil || fl.Pool.Misses != 1 || fl.Pool.Hits != 0 {
			t.Errorf("%s: accepted %d, pool %+v; want at most %d connections and one entry into the pool", mode, fl.Accepted, fl.Pool, workers)
		}
	}
	// Proxy set: client-go builds a transport, so a connection, per request.
	if cp := modes["client-go-proxy"]; cp.Accepted < requests || cp.FullHandshakes < requests {
		t.Errorf("client-go-proxy: accepted %d, full handshakes %d; want at least %d", cp.Accepted, cp.FullHandshakes, requests)
	}
	// Karmada's fix: a connection and a full handshake per request.
	if ka := modes["client-go-keepalive-off"]; ka.Accepted < requests || ka.FullHandshakes < requests || ka.Resumed != 0 {
		t.Errorf("client-go-keepalive-off: accepted %d, full %d, resumed %d", ka.Accepted, ka.FullHandshakes, ka.Resumed)
	}
	// The library with keep-alive off: a connection per request, but after
	// the first wave of workers the handshakes resume.
	if so := modes["sharedtransport-keepalive-off"]; so.Accepted < requests || so.FullHandshakes > 20 || so.Resumed < requests-20 {
		t.Errorf("sharedtransport-keepalive-off: accepted %d, full %d, resumed %d; want at most 20 full handshakes", so.Accepted, so.FullHandshakes, so.Resumed)
	}
	for _, s := range rep.Modes {
		if s.ServerCPUPerRequestUs == nil || s.ServerCPUPerRequestUs.Median <= 0 {
			t.Errorf("%s: server CPU per request %v", s.Mode, s.ServerCPUPerRequestUs)
		}
		if s.Mode == "client-go" && (s.VsClientGo == nil || s.VsClientGo.Connections.OfMedians != 1) {
			t.Errorf("client-go ratio: %+v", s.VsClientGo)
		}
	}
	b, err := os.ReadFile(svg)
	if err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(b))
	for {
		if _, err := dec.Token(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("svg is not well-formed XML: %v", err)
		}
	}
	if n := strings.Count(string(b), "<polyline"); n != len(defaultModes) {
		t.Errorf("svg has %d lines, want %d", n, len(defaultModes))
	}
}

func TestTableOutput(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"--workers", "3", "--requests", "2", "--repeat", "2", "--modes", "client-go,sharedtransport"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s", err, errb.String())
	}
	for _, want := range []string{"conns accepted", "peak open", "full TLS hs", "resumed", "req/s", "p99 ms", "client CPU µs/req",
		"server CPU µs/req", "client max RSS MiB", "median [min-max] of the 2 runs", "vs client-go", "client-go ", "sharedtransport ", "ConnState"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	if !strings.Contains(errb.String(), "round 2/2 sharedtransport") {
		t.Errorf("no progress on stderr: %q", errb.String())
	}
}

// --kubeconfig: conncount counts a cluster's connections in the kernel's
// tables (Tcp ActiveOpens, the client process's sockets) and takes
// handshakes from the library's Stats, or one full handshake per connection
// for client-go. Every figure of every run is compared with what the API
// server, here in the test's process, counted over that run, and the test
// fails where they differ. ActiveOpens counts every connection of the
// network namespace, so the test runs in a network namespace of its own,
// where nothing but it and its children open connections.
func TestClusterTarget(t *testing.T) {
	if !inOwnNetworkNamespace(t) {
		return
	}
	srv, err := testserver.Start(testserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	kp, err := srv.CA().IssueClient("viewer")
	if err != nil {
		t.Fatal(err)
	}
	p, err := srv.WriteKubeconfig(filepath.Join(t.TempDir(), "kubeconfig"), kp, false)
	if err != nil {
		t.Fatal(err)
	}
	const workers, requests = 5, 4
	o, err := parseFlags([]string{"--kubeconfig", p.Kubeconfig, "--workers", fmt.Sprint(workers), "--requests", fmt.Sprint(requests),
		"--repeat", "1", "--resource", "namespaces", "--progress=false"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ct, err := newClusterTarget(p.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(ct.Sources()["accepted"], "ActiveOpens") {
		t.Errorf("sources: %v", ct.Sources())
	}
	const total = workers * requests
	for i, tc := range []struct {
		mode            string
		handshakeSource string
		accepted        uint64 // connections the server accepts, at most
		openAtEnd       int64  // -1: any
	}{
		// A transport, so a connection and a full handshake, per config; none closes.
		{"client-go-proxy", "inferred (one per connection)", total, total},
		// Karmada's keep-alive off: the same, each closed after its request.
		{"client-go-keepalive-off", "inferred (one per connection)", total, -1},
		// The pool: one transport, dialing for each worker waiting on the
		// cold start at most.
		{"sharedtransport", "library Stats", workers, -1},
		// The pool with keep-alive off: a connection per request, most
		// handshakes resumed.
		{"sharedtransport-keepalive-off", "library Stats", total, -1},
	} {
		srv.ResetStats()
		r, err := runOnce(context.Background(), o, ct, tc.mode, 1, i+1, io.Discard)
		if err != nil {
			t.Fatalf("%s: %v", tc.mode, err)
		}
		st := srv.Stats()
		t.Logf("%-30s conncount: accepted %d, peak %d, open at end %d, full %d, resumed %d; server: accepted %d, peak %d, full %d, resumed %d, requests %d",
			tc.mode, r.Accepted, r.PeakOpen, r.OpenAtEnd, r.FullHandshakes, r.Resumed, st.Accepted, st.PeakOpen, st.FullHandshakes, st.ResumedHandshakes, st.Requests)
		if r.Requests != total || r.Errors != 0 || st.Requests != total {
			t.Errorf("%s: conncount sent %d requests (%d errors: %s), the server served %d; want %d", tc.mode, r.Requests, r.Errors, r.FirstError, st.Requests, total)
		}
		if r.Accepted != int64(st.Accepted) || r.FullHandshakes != int64(st.FullHandshakes) || r.Resumed != int64(st.ResumedHandshakes) {
			t.Errorf("%s: conncount says %d connections, %d full and %d resumed handshakes; the server counted %d, %d and %d",
				tc.mode, r.Accepted, r.FullHandshakes, r.Resumed, st.Accepted, st.FullHandshakes, st.ResumedHandshakes)
		}
		// Open connections are sampled: never more than the server's peak.
		if r.PeakOpen > int64(st.PeakOpen) || r.OpenAtEnd > r.PeakOpen {
			t.Errorf("%s: conncount says peak %d, %d open at the end; the server's peak was %d", tc.mode, r.PeakOpen, r.OpenAtEnd, st.PeakOpen)
		}
		if exact := tc.mode != "sharedtransport"; exact && st.Accepted != tc.accepted || st.Accepted > tc.accepted ||
			tc.openAtEnd >= 0 && (r.OpenAtEnd != tc.openAtEnd || r.PeakOpen != int64(st.PeakOpen)) {
			t.Errorf("%s: the server accepted %d (peak %d), conncount saw %d open at the end (peak %d); want %d accepted, %d open at the end",
				tc.mode, st.Accepted, st.PeakOpen, r.OpenAtEnd, r.PeakOpen, tc.accepted, tc.openAtEnd)
		}
		if tc.mode == "sharedtransport-keepalive-off" && st.ResumedHandshakes == 0 {
			t.Errorf("%s: no resumed handshake at the server", tc.mode)
		}
		if r.HandshakeSource != tc.handshakeSource {
			t.Errorf("%s: handshakes from %q, want %q", tc.mode, r.HandshakeSource, tc.handshakeSource)
		}
		if r.PID == os.Getpid() || r.PID <= 0 || r.ServerPID != 0 || r.ServerCPUSeconds != nil {
			t.Errorf("%s: client PID %d (the test is %d), server PID %d, server CPU %v; want a child and no server process", tc.mode, r.PID, os.Getpid(), r.ServerPID, r.ServerCPUSeconds)
		}
	}
}

// inOwnNetworkNamespace runs the calling test again, alone, in a child
// process in new user and network namespaces with the loopback interface up.
// It returns true in the child, where the test goes on, and false in the
// parent, which waits for the child and reports its result.
func inOwnNetworkNamespace(t *testing.T) bool {
	t.Helper()
	return nstest.Rerun(t, nstest.Namespaces{
		Env:        "CONNCOUNT_TEST_NETNS",
		Cloneflags: syscall.CLONE_NEWNET,
		Where:      "a network namespace of its own",
		Timeout:    5 * time.Minute,
		Setup:      loopbackUp,
	})
}

// loopbackUp sets the lo interface of this network namespace up, as
// "ip link set lo up" does.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	run1 := func(args ...string) error {
		var out, errb bytes.Buffer
		start := time.Now()
		err := run(context.Background(), append([]string{"--progress=false", "--workers", "2", "--requests", "1", "--repeat", "1"}, args...), &out, &errb)
		if d := time.Since(start); d > 15*time.Second {
			t.Errorf("%v took %v", args, d)
		}
		if err == nil {
			t.Errorf("%v: no error", args)
			return errors.New("")
		}
		return err
	}

	t.Run("unreadable kubeconfig", func(t *testing.T) {
		path := filepath.Join(dir, "missing", "kubeconfig")
		err := run1("--kubeconfig", path)
		if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "cannot read kubeconfig") {
			t.Errorf("error does not name the file: %v", err)
		}
		garbage := filepath.Join(dir, "garbage")
		os.WriteFile(garbage, []byte("{{{ not yaml"), 0o600)
		if err := run1("--kubeconfig", garbage); !strings.Contains(err.Error(), garbage) {
			t.Errorf("error does not name the file: %v", err)
		}
	})

	t.Run("unreachable server", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		ca, _ := testserver.NewCA("ca")
		kp, _ := ca.IssueClient("someone")
		p, err := testserver.WriteKubeconfig(filepath.Join(dir, "unreachable"), testserver.Kubeconfig{
			Server: "https://" + addr, CAPEM: ca.CertPEM(), CertPEM: kp.CertPEM, KeyPEM: kp.KeyPEM, Inline: true})
		if err != nil {
			t.Fatal(err)
		}
		err = run1("--kubeconfig", p.Kubeconfig)
		if !strings.Contains(err.Error(), "cannot reach API server https://"+addr) {
			t.Errorf("error: %v", err)
		}
	})

	t.Run("forbidden list", func(t *testing.T) {
		srv, err := testserver.Start(testserver.Options{Authorize: func(a testserver.Attributes) bool {
			return !(a.Verb == "list" && a.Resource == "nodes")
		}})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		kp, _ := srv.CA().IssueClient("limited")
		p, err := srv.WriteKubeconfig(filepath.Join(dir, "forbidden"), kp, true)
		if err != nil {
			t.Fatal(err)
		}
		err = run1("--kubeconfig", p.Kubeconfig)
		if !strings.Contains(err.Error(), `forbids verb "list" on resource "nodes"`) {
			t.Errorf("error: %v", err)
		}
		// The same user may list namespaces.
		var out, errb bytes.Buffer
		if err := run(context.Background(), []string{"--kubeconfig", p.Kubeconfig, "--resource", "namespaces", "--modes", "sharedtransport",
			"--workers", "2", "--requests", "1", "--repeat", "1", "--progress=false"}, &out, &errb); err != nil {
			t.Errorf("namespaces: %v", err)
		}
	})

	t.Run("flags", func(t *testing.T) {
		for _, args := range [][]string{{"--modes", "nope"}, {"--resource", "pods"}, {"--workers", "0"}, {"--repeat", "0"}, {"--modes", "client-go,client-go"}, {"extra"}} {
			if err := run1(args...); !errors.Is(err, errUsage) {
				t.Errorf("%v: %v, want a usage error", args, err)
			}
		}
	})
}
