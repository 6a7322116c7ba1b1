package testserver

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"

	"github.com/sharedtransport/sharedtransport/internal/childproc"
)

// Process is a Server run in a child process (internal/childproc), so that
// what it allocates is not measured as the parent's. It requires client
// certificates issued by CA.
type Process struct {
	URL   string
	CA    *CA
	child *childproc.Child
}

// processSpec is what the parent sends the child: the serving certificate
// and the CA that issued it and the clients'.
type processSpec struct {
	CAPEM, CertPEM, KeyPEM []byte
}

// StartProcess starts a Server in a child process run with opts; the child
// must call ServeProcess (through childproc.Main) under role.
func StartProcess(ctx context.Context, role string, opts childproc.Options) (*Process, error) {
	ca, err := NewCA("member-process-ca")
	if err != nil {
		return nil, err
	}
	serving, err := ca.IssueServer()
	if err != nil {
		return nil, err
	}
	var url string
	c, err := childproc.Start(ctx, role, opts, processSpec{CAPEM: ca.CertPEM(), CertPEM: serving.CertPEM, KeyPEM: serving.KeyPEM}, &url)
	if err != nil {
		return nil, err
	}
	return &Process{URL: url, CA: ca, child: c}, nil
}

// Stats returns the child's server's Stats.
func (p *Process) Stats(ctx context.Context) (Stats, error) {
	var st Stats
	err := p.child.Call(ctx, "stats", &st)
	return st, err
}

// ResetStats zeroes the child's server's counters.
func (p *Process) ResetStats(ctx context.Context) error { return p.child.Call(ctx, "reset", nil) }

// Close stops the child and returns its exit status.
func (p *Process) Close() error { return p.child.Close() }

// ServeProcess is the child's side of StartProcess, a childproc.Starter.
func ServeProcess(specJSON []byte) (any, childproc.Role, error) {
	var spec processSpec
	if err := json.Unmarshal(specJSON, &spec); err != nil {
		return nil, nil, err
	}
	block, _ := pem.Decode(spec.CertPEM)
	if block == nil {
		return nil, nil, errors.New("serving certificate: no PEM block")
	}
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("serving certificate: %w", err)
	}
	clientCAs := x509.NewCertPool()
	if !clientCAs.AppendCertsFromPEM(spec.CAPEM) {
		return nil, nil, errors.New("CA: no certificate")
	}
	srv, err := Start(Options{
		ServerCert: &KeyPair{CertPEM: spec.CertPEM, KeyPEM: spec.KeyPEM, Cert: leaf},
		ClientCAs:  clientCAs,
	})
	if err != nil {
		return nil, nil, err
	}
	return srv.URL(), processRole{srv}, nil
}

type processRole struct{ srv *Server }

func (r processRole) Handle(_ context.Context, cmd string) (any, error) {
	switch cmd {
	case "stats":
		return r.srv.Stats(), nil
	case "reset":
		r.srv.ResetStats()
		return nil, nil
	}
	return nil, fmt.Errorf("unknown command %q", cmd)
}

func (r processRole) Close() { _ = r.srv.Close() }
