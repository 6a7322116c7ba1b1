package fakeopenstack

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"

	"github.com/sharedtransport/sharedtransport/internal/childproc"
	"github.com/sharedtransport/sharedtransport/internal/procnet"
)

// processEnv names the role of a child started by StartProcess.
const processEnv = "FAKEOPENSTACK_PROCESS"

// Main serves the Server a parent started with StartProcess when this
// process is that child, and returns its exit code with isChild true;
// otherwise it returns at once. A test binary calls it first in TestMain.
func Main() (code int, isChild bool) {
	return childproc.Main(processEnv, map[string]childproc.Starter{"openstack": serveProcess})
}

// Process is a Server run in a child process of this executable, so that
// the connections, goroutines and heap of the process under test are its
// clients' alone.
type Process struct {
	URL   string
	CA    []byte
	child *childproc.Child
}

// processReady is the child's answer once its server listens.
type processReady struct {
	URL string
	CA  []byte
}

// StartProcess starts a Server with opts in a child process of this
// executable, which must call Main first.
func StartProcess(ctx context.Context, opts Options) (*Process, error) {
	var ready processReady
	c, err := childproc.Start(ctx, "openstack", childproc.Options{Env: processEnv}, opts, &ready)
	if err != nil {
		return nil, err
	}
	return &Process{URL: ready.URL, CA: ready.CA, child: c}, nil
}

// Counts returns what the child's server saw so far.
func (p *Process) Counts(ctx context.Context) (Counts, error) {
	var c Counts
	err := p.child.Call(ctx, "counts", &c)
	return c, err
}

// Close stops the child, which closes every connection.
func (p *Process) Close() error { return p.child.Close() }

func serveProcess(spec []byte) (any, childproc.Role, error) {
	var opts Options
	if err := json.Unmarshal(spec, &opts); err != nil {
		return nil, nil, err
	}
	s, err := Start(opts)
	if err != nil {
		return nil, nil, err
	}
	return processReady{URL: s.URL, CA: s.CA}, processRole{s}, nil
}

type processRole struct{ s *Server }

func (r processRole) Handle(_ context.Context, cmd string) (any, error) {
	if cmd == "counts" {
		return r.s.Counts(), nil
	}
	return nil, fmt.Errorf("unknown command %q", cmd)
}

func (r processRole) Close() { r.s.Close() }

// Established counts this process's TCP connections in state ESTABLISHED
// toward serverURL's port, from the kernel's socket table (Linux): what
// CAPO issue 3227 counts. A server in the same process is not counted: its
// sockets have the port on their own end.
func Established(serverURL string) (int, error) {
	u, err := url.Parse(serverURL)
	if err != nil {
		return 0, err
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		return 0, fmt.Errorf("fakeopenstack: no port in %q", serverURL)
	}
	conns, err := procnet.Mine()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, c := range conns {
		if c.State == procnet.Established && c.RemotePort == port {
			n++
		}
	}
	return n, nil
}
