package sharedtransport

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// checkExecRotation: when an exec plugin's certificate changes, client-go
// closes the connections its authenticator dialed, so that the next
// handshake presents the new certificate. The pool's connections must be
// among them, also for a config with its own Dial (WithDialIdentity), and
// the next handshake must not resume a session of the old certificate.
func checkExecRotation(t *testing.T, opts ...Option) {
	var mu sync.Mutex
	var lastCN string
	f := newFixture(t, testserver.Options{OnRequest: func(ri testserver.RequestInfo) {
		mu.Lock()
		lastCN = ri.CertCN
		mu.Unlock()
	}})
	seen := func() string {
		mu.Lock()
		defer mu.Unlock()
		return lastCN
	}
	for _, customDial := range []bool{false, true} {
		t.Run(fmt.Sprintf("custom Dial %v", customDial), func(t *testing.T) {
			before, err := f.ca.IssueClient("exec-before")
			if err != nil {
				t.Fatal(err)
			}
			after, err := f.ca.IssueClient("exec-after")
			if err != nil {
				t.Fatal(err)
			}
			name := fmt.Sprintf("rotating-%v", customDial)
			exec := writeExecPlugin(t, f.dir, name, before)
			// The plugin's first credential expires soon: client-go runs
			// the plugin again on the first request after that.
			expiry := time.Now().Add(2 * time.Second).Truncate(time.Second)
			writeExecCredential(t, f.dir, name, before, expiry)

			p := newPool(t, append([]Option{WithDialIdentity(func(*rest.Config) string { return "plain" })}, opts...)...)
			cfg := f.srv.RestConfig(nil)
			cfg.ExecProvider = exec
			// A config with its own Dial: HTTPClientFor, as Wrap passes it
			// through.
			var cs kubernetes.Interface
			if customDial {
				cfg.Dial = (&net.Dialer{}).DialContext
				cs, err = pooledClientset(p, cfg)
			} else {
				cs, err = wrapped(cfg, wrapFn(p))
			}
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
				t.Fatal(err)
			}
			if got := seen(); got != "exec-before" {
				t.Fatalf("server saw %q, want exec-before", got)
			}
			writeExecCredential(t, f.dir, name, after, time.Time{})
			time.Sleep(time.Until(expiry) + 100*time.Millisecond)
			for range 2 { // the first request runs the plugin again
				if _, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			st := p.Stats()
			if got := seen(); got != "exec-after" {
				t.Errorf("after the plugin's certificate changed the server saw %q, want exec-after (pool %+v)", got, st)
			}
			if st.PassThrough != 0 || st.Identities != 1 {
				t.Errorf("pool %+v: the config was not served by the pool", st)
			}
		})
	}
}

// TestExecCertRotation: the pool's connections close with the exec
// authenticator's, with client-go's dialer and with a config's own Dial.
// Session resumption is off here; see TestExecCertRotationResumption.
func TestExecCertRotation(t *testing.T) {
	checkExecRotation(t, WithSessionResumption(false))
}

// TestExecCertRotationResumption: with the default options (session
// resumption on), the connection after an exec plugin's certificate changed
// must authenticate with the new certificate, not resume a session of the
// old one.
func TestExecCertRotationResumption(t *testing.T) {
	checkExecRotation(t)
}
