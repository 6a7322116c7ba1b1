package main

// conncount proxy: the seed's own scenario. Karmada's aggregated apiserver
// proxies requests to member clusters and builds each member's config from
// its Secret for every request (internal/memberproxy). The load goes through
// that front to embedded member servers, which count the connections they
// accept.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/sharedtransport/sharedtransport"
	"github.com/sharedtransport/sharedtransport/internal/memberproxy"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

type proxyModeDef struct {
	name, desc string
	mode       memberproxy.Mode
	pool       []sharedtransport.Option // nil: no pool
}

var proxyModes = []proxyModeDef{
	{"new-transport", "Karmada before PR 5610: a new transport per request (issue 5574)", memberproxy.NewTransport, nil},
	{"new-transport-keepalive-off", "Karmada since PR 5610: a new transport per request, keep-alive off", memberproxy.NewTransportNoKeepAlive, nil},
	{"sharedtransport", "rest.TransportFor on a config the pool wrapped (one line in the front)", memberproxy.TransportFor, []sharedtransport.Option{}},
	{"sharedtransport-keepalive-off", "the same, the pool with keep-alive off (TLS session resumption on)", memberproxy.TransportFor, []sharedtransport.Option{sharedtransport.WithKeepAlive(false)}},
}

var defaultProxyModes = []string{"new-transport", "new-transport-keepalive-off", "sharedtransport"}

type proxyOptions struct {
	members, workers, requests int
	modes                      []string
	json                       bool
	timeout                    time.Duration
}

func parseProxyFlags(args []string, stderr io.Writer) (*proxyOptions, error) {
	o := &proxyOptions{}
	fs := flag.NewFlagSet("conncount proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var modes string
	fs.IntVar(&o.members, "members", 3, "member clusters behind the front (odd ones authenticate the front by client certificate, even ones by token)")
	fs.IntVar(&o.workers, "workers", 100, "concurrent clients of the front")
	fs.IntVar(&o.requests, "requests", 50, "requests per client, spread over the members")
	fs.StringVar(&modes, "modes", strings.Join(defaultProxyModes, ","), "comma-separated modes to run, in order")
	fs.BoolVar(&o.json, "json", false, "print the results as JSON instead of a table")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "timeout of one request")
	var modeHelp [][2]string
	for _, m := range proxyModes {
		modeHelp = append(modeHelp, [2]string{m.name, m.desc})
	}
	if err := parseFlagSet(fs, args, "Usage: conncount proxy [flags]\n\nRuns the seed's load through a Karmada-style front (a rest.Config per request, built from the\nmember's Secret) to embedded member servers, which count the connections they accept. Modes:\n", modeHelp); err != nil {
		return nil, err
	}
	if o.members < 1 || o.workers < 1 || o.requests < 1 {
		return nil, fmt.Errorf("%w: --members, --workers and --requests must be at least 1", errUsage)
	}
	for _, name := range strings.Split(modes, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if findProxyMode(name) == nil {
			var known []string
			for _, m := range proxyModes {
				known = append(known, m.name)
			}
			return nil, fmt.Errorf("%w: unknown mode %q (known: %s)", errUsage, name, strings.Join(known, ", "))
		}
		o.modes = append(o.modes, name)
	}
	if len(o.modes) == 0 {
		return nil, fmt.Errorf("%w: --modes is empty", errUsage)
	}
	return o, nil
}

func findProxyMode(name string) *proxyModeDef {
	for i := range proxyModes {
		if proxyModes[i].name == name {
			return &proxyModes[i]
		}
	}
	return nil
}

type memberResult struct {
	Name      string `json:"name"`
	Auth      string `json:"auth"`
	Requests  int64  `json:"requests"`
	Accepted  uint64 `json:"connections_accepted"`
	Full      uint64 `json:"full_handshakes"`
	Resumed   uint64 `json:"resumed_handshakes"`
	OpenAtEnd int    `json:"open_at_end"`
}

type proxyModeResult struct {
	Mode              string                 `json:"mode"`
	Description       string                 `json:"description"`
	Requests          int64                  `json:"requests"`
	Errors            int64                  `json:"errors"`
	FirstError        string                 `json:"first_error,omitempty"`
	Seconds           float64                `json:"seconds"`
	RequestsPerSecond float64                `json:"requests_per_second"`
	P50ms             float64                `json:"p50_ms"`
	P99ms             float64                `json:"p99_ms"`
	Members           []memberResult         `json:"members"`
	Pool              *sharedtransport.Stats `json:"pool_stats,omitempty"`
}

type proxyReport struct {
	Members  int                `json:"members"`
	Workers  int                `json:"workers"`
	Requests int                `json:"requests_per_worker"`
	Started  string             `json:"started"`
	Modes    []*proxyModeResult `json:"modes"`
}

type member struct {
	name, auth string
	srv        *testserver.Server
}

func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseProxyFlags(args, stderr)
	if err != nil {
		return err
	}
	clusters := memberproxy.NewClusters()
	var members []member
	defer func() {
		for _, m := range members {
			m.srv.Close()
		}
	}()
	for i := range o.members {
		m, cl, err := startMember(i)
		if err != nil {
			return err
		}
		members = append(members, m)
		clusters.Set(cl)
	}
	rep := &proxyReport{Members: o.members, Workers: o.workers, Requests: o.requests, Started: time.Now().UTC().Format(time.RFC3339)}
	for _, name := range o.modes {
		if err := ctx.Err(); err != nil {
			return err
		}
		res, err := runProxyMode(ctx, o, findProxyMode(name), clusters, members)
		if err != nil {
			return fmt.Errorf("mode %s: %w", name, err)
		}
		rep.Modes = append(rep.Modes, res)
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	rep.writeTable(stdout)
	return nil
}

// startMember starts member i: an embedded API server with a CA of its own.
// The front authenticates to odd members by client certificate and to even
// ones by bearer token, as Karmada's clusters do by their Secrets.
func startMember(i int) (member, memberproxy.Cluster, error) {
	name := fmt.Sprintf("member-%d", i+1)
	ca, err := testserver.NewCA(name + "-ca")
	if err != nil {
		return member{}, memberproxy.Cluster{}, err
	}
	token := name + "-token"
	srv, err := testserver.Start(testserver.Options{
		CA:         ca,
		ClientAuth: testserver.VerifyClientCertIfGiven,
		Tokens:     map[string]string{token: "karmada-front"},
	})
	if err != nil {
		return member{}, memberproxy.Cluster{}, err
	}
	cl := memberproxy.Cluster{Name: name, APIEndpoint: srv.URL(), Secret: memberproxy.Secret{CAData: ca.CertPEM()}}
	auth := "token"
	if i%2 == 0 {
		kp, err := ca.IssueClient("karmada-front")
		if err != nil {
			srv.Close()
			return member{}, memberproxy.Cluster{}, err
		}
		cl.Secret.CertData, cl.Secret.KeyData = kp.CertPEM, kp.KeyPEM
		auth = "client certificate"
	} else {
		cl.Secret.Token = token
	}
	return member{name: name, auth: auth, srv: srv}, cl, nil
}

func runProxyMode(ctx context.Context, o *proxyOptions, def *proxyModeDef, clusters *memberproxy.Clusters, members []member) (*proxyModeResult, error) {
	for _, m := range members {
		m.srv.CloseClientConnections()
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, m := range members {
		for m.srv.OpenConns() > 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		m.srv.ResetStats()
	}

	front := &memberproxy.Front{Clusters: clusters, Mode: def.mode}
	var pool *sharedtransport.Pool
	if def.pool != nil {
		pool = sharedtransport.New(def.pool...)
		defer pool.Close()
		front.Wrap = pool.Wrap
	}
	srv := httptest.NewServer(front)
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: o.workers}, Timeout: o.timeout}
	defer client.CloseIdleConnections()

	var failed atomic.Int64
	var firstErr atomic.Value
	perMember := make([]atomic.Int64, len(members))
	lat := make([][]time.Duration, o.workers)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range o.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range o.requests {
				if ctx.Err() != nil {
					return
				}
				m := (w*o.requests + i) % len(members)
				t0 := time.Now()
				err := listThroughFront(ctx, client, srv.URL, members[m].name)
				lat[w] = append(lat[w], time.Since(t0))
				perMember[m].Add(1)
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	res := &proxyModeResult{Mode: def.name, Description: def.desc, Errors: failed.Load(), Seconds: elapsed.Seconds()}
	if s, ok := firstErr.Load().(string); ok {
		res.FirstError = s
	}
	for i, m := range members {
		st := m.srv.Stats()
		res.Requests += perMember[i].Load()
		res.Members = append(res.Members, memberResult{
			Name: m.name, Auth: m.auth, Requests: perMember[i].Load(),
			Accepted: st.Accepted, Full: st.FullHandshakes, Resumed: st.ResumedHandshakes, OpenAtEnd: st.Open,
		})
	}
	if res.Requests > 0 {
		res.RequestsPerSecond = float64(res.Requests) / elapsed.Seconds()
	}
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	res.P50ms, res.P99ms = percentile(all, 0.50), percentile(all, 0.99)
	if pool != nil {
		st := pool.Stats()
		res.Pool = &st
	}
	return res, nil
}

func listThroughFront(ctx context.Context, client *http.Client, frontURL, cluster string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, frontURL+memberproxy.PathPrefix+cluster+"/proxy/api/v1/nodes", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", cluster, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

func (r *proxyReport) writeTable(w io.Writer) {
	fmt.Fprintf(w, "conncount proxy: %d clients x %d requests through a Karmada-style front (a rest.Config per request from the member's Secret) to %d members, list nodes\n",
		r.Workers, r.Requests, r.Members)
	fmt.Fprintf(w, "connections and handshakes counted by the member servers\n\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	header := []string{"mode", "requests", "errors"}
	if len(r.Modes) > 0 {
		for _, m := range r.Modes[0].Members {
			header = append(header, m.Name+" conns")
		}
	}
	header = append(header, "conns", "full handshakes", "resumed", "open at end", "req/s", "p50 ms", "p99 ms", "")
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, m := range r.Modes {
		row := []string{m.Mode, fmt.Sprint(m.Requests), fmt.Sprint(m.Errors)}
		var conns, full, resumed uint64
		open := 0
		for _, mr := range m.Members {
			row = append(row, fmt.Sprint(mr.Accepted))
			conns += mr.Accepted
			full += mr.Full
			resumed += mr.Resumed
			open += mr.OpenAtEnd
		}
		row = append(row, fmt.Sprint(conns), fmt.Sprint(full), fmt.Sprint(resumed), fmt.Sprint(open),
			fmt.Sprintf("%.0f", m.RequestsPerSecond), trimFloat(m.P50ms), trimFloat(m.P99ms), "")
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, m := range r.Modes {
		fmt.Fprintf(w, "%-30s %s\n", m.Mode, m.Description)
		if m.FirstError != "" {
			fmt.Fprintf(w, "%-30s first error: %s\n", "", m.FirstError)
		}
	}
	if len(r.Modes) > 0 {
		fmt.Fprintln(w)
		for _, m := range r.Modes[0].Members {
			fmt.Fprintf(w, "%s: the front authenticates by %s\n", m.Name, m.Auth)
		}
	}
}
