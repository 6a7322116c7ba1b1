// Command conncount shows, side by side, how many TCP connections and TLS
// handshakes a Kubernetes client makes under the load of Karmada issue 5574:
// many workers, every request through a fresh rest.Config and clientset.
//
// Every run of a mode happens in a fresh client process of its own (child.go),
// so that no mode is measured with another's leftovers; the table is put
// together from what the children report. With no flags each run also gets a
// fresh embedded API server (internal/testserver) in a process of its own,
// which counts connections and handshakes and reports its own CPU time. With
// --kubeconfig the same read-only load runs against a real cluster and
// connections are counted from the kernel's socket tables. --repeat runs
// the modes in rounds; each figure is then a median with its range.
//
// conncount is a module of its own (it serves the pool's Prometheus
// collector, and the library's module depends on no metrics library); from
// the repository's root, run it with go -C, which also makes relative paths
// such as --svg's relative to cmd/conncount:
//
//	go -C cmd/conncount run .
//	go -C cmd/conncount run . --workers 20 --requests 5 --repeat 1 --json
//	go -C cmd/conncount run . --svg conns.svg --svg-modes client-go,client-go-proxy,sharedtransport
//	go -C cmd/conncount run . --kubeconfig ~/.kube/config --resource namespaces
//
// The proxy subcommand runs the seed's own scenario (proxy.go): the load goes
// through a Karmada-style aggregated-apiserver front, which builds a config
// per request from the member's Secret, to embedded member servers (every
// third one behind a CONNECT proxy that requires a header); the load, the
// front and the members each run in fresh processes per run. After its
// tables it prints the pool's own view of each member beside the members'
// counts (poolview.go), and with --scrape the scrape of the pool's collector:
//
//	go -C cmd/conncount run . proxy
//	go -C cmd/conncount run . proxy --members 3 --workers 100 --requests 50 --json
//	go -C cmd/conncount run . proxy --modes sharedtransport --scrape
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"
)

type options struct {
	kubeconfig string
	workers    int
	requests   int
	repeat     int
	modes      []string
	duration   time.Duration
	resource   string
	json       bool
	svg        string
	svgModes   []string
	timeout    time.Duration
	sample     time.Duration
	progress   bool
	cpuProfile string
}

// Defaults of the load. Five rounds of 2,000 requests per mode keep the
// default command within about a minute on a 2-core machine shared with
// other work, and a median of five stands still when two rounds are
// disturbed.
const (
	defaultWorkers  = 100
	defaultRequests = 20
	defaultRepeat   = 5
)

// errUsage marks errors in the command line (exit status 2).
var errUsage = errors.New("usage")

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("conncount", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var modes string
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "run against the cluster of this kubeconfig (read-only: list --resource) instead of the embedded server")
	fs.IntVar(&o.workers, "workers", defaultWorkers, "concurrent workers")
	fs.IntVar(&o.requests, "requests", defaultRequests, "requests per worker, each through a fresh rest.Config and clientset")
	fs.IntVar(&o.repeat, "repeat", defaultRepeat, "rounds of all modes; each figure is the median of the rounds, with its range")
	fs.StringVar(&modes, "modes", strings.Join(defaultModes, ","), "comma-separated modes to run, in order (round r starts at the r-th); known: "+strings.Join(modeNames(), ", "))
	fs.DurationVar(&o.duration, "duration", 0, "stop a mode after this long even if requests are left (0: no limit)")
	fs.StringVar(&o.resource, "resource", "nodes", "what each request lists: nodes or namespaces")
	fs.BoolVar(&o.json, "json", false, "print the results as JSON instead of a table")
	fs.StringVar(&o.svg, "svg", "", "write a chart of open connections over time per mode to this SVG file")
	var svgModes string
	fs.StringVar(&svgModes, "svg-modes", "", "comma-separated modes the --svg chart shows (default: every mode run)")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "timeout of one request")
	fs.DurationVar(&o.sample, "sample", 20*time.Millisecond, "how often open connections are sampled for --svg and the peak (real clusters: at least 50ms)")
	fs.BoolVar(&o.progress, "progress", true, "show progress on stderr while a mode runs")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of each run's load (client process) to this path + .MODE.ROUND")
	var modeHelp [][2]string
	for _, m := range allModes {
		modeHelp = append(modeHelp, [2]string{m.name, m.desc})
	}
	if err := parseFlagSet(fs, args, "Usage: conncount [flags]\n\nRuns the seed's load (workers x requests, a fresh rest.Config and clientset per request)\nin several modes and counts connections and TLS handshakes. Modes:\n", modeHelp); err != nil {
		return nil, err
	}
	if o.workers < 1 || o.requests < 1 || o.repeat < 1 {
		return nil, fmt.Errorf("%w: --workers, --requests and --repeat must be at least 1", errUsage)
	}
	switch o.resource {
	case "nodes", "namespaces":
	default:
		return nil, fmt.Errorf("%w: --resource must be nodes or namespaces, not %q", errUsage, o.resource)
	}
	for _, name := range strings.Split(modes, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		if findMode(name) == nil {
			return nil, fmt.Errorf("%w: unknown mode %q (known: %s)", errUsage, name, strings.Join(modeNames(), ", "))
		}
		if slices.Contains(o.modes, name) {
			return nil, fmt.Errorf("%w: mode %q given twice (--repeat runs it again)", errUsage, name)
		}
		o.modes = append(o.modes, name)
	}
	if len(o.modes) == 0 {
		return nil, fmt.Errorf("%w: --modes is empty", errUsage)
	}
	for _, name := range strings.Split(svgModes, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if !slices.Contains(o.modes, name) {
			return nil, fmt.Errorf("%w: --svg-modes: mode %q is not run (--modes: %s)", errUsage, name, strings.Join(o.modes, ","))
		}
		o.svgModes = append(o.svgModes, name)
	}
	if o.sample <= 0 {
		o.sample = 20 * time.Millisecond
	}
	if o.kubeconfig != "" && o.sample < 50*time.Millisecond {
		o.sample = 50 * time.Millisecond
	}
	return o, nil
}

func main() {
	if code, ok := childMain(); ok {
		os.Exit(code)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errUsage):
		fmt.Fprintf(os.Stderr, "conncount: %v\n", strings.TrimPrefix(err.Error(), "usage: "))
		os.Exit(2)
	default:
		fmt.Fprintf(os.Stderr, "conncount: %v\n", err)
		os.Exit(1)
	}
}

// run is the whole command; main and the tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	stderr = childStderr(stderr)
	if len(args) > 0 && args[0] == "proxy" {
		return runProxy(ctx, args[1:], stdout, stderr)
	}
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	var t target
	if o.kubeconfig != "" {
		ct, err := newClusterTarget(o.kubeconfig)
		if err != nil {
			return err
		}
		if err := preflight(ctx, ct.cfg, o.resource); err != nil {
			return err
		}
		t = ct
	} else if t, err = newEmbeddedTarget(); err != nil {
		return err
	}
	defer t.close()
	rep := &report{
		Target:   t.Describe(),
		Sources:  t.Sources(),
		Workers:  o.workers,
		Requests: o.requests,
		Resource: o.resource,
		Repeat:   o.repeat,
		Started:  time.Now().UTC().Format(time.RFC3339),
	}
	names, rounds := runOrder(o.modes, o.repeat)
	for i, name := range names {
		res, err := runOnce(ctx, o, t, name, rounds[i], i+1, stderr)
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if err != nil {
			return fmt.Errorf("mode %s, round %d: %w", name, rounds[i], err)
		}
		rep.Runs = append(rep.Runs, res)
	}
	rep.summarize(o.modes)
	if o.svg != "" {
		if err := os.WriteFile(o.svg, []byte(rep.svg(o.svgModes)), 0o644); err != nil {
			return fmt.Errorf("write --svg: %w", err)
		}
	}
	if o.json {
		return rep.writeJSON(stdout)
	}
	rep.writeTable(stdout)
	return nil
}

// parseFlagSet parses args into fs, whose usage lists modes (name, description)
// after head. Bad flags and stray arguments are usage errors.
func parseFlagSet(fs *flag.FlagSet, args []string, head string, modes [][2]string) error {
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), head)
		for _, m := range modes {
			fmt.Fprintf(fs.Output(), "  %-30s %s\n", m[0], m[1])
		}
		fmt.Fprintf(fs.Output(), "\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	return nil
}
