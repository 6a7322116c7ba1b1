// What CAPO logs at -v=10, as is and patched: capo/hack/test-capo.sh copies
// this file into CAPO's pkg/scope.

package scope_test

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"k8s.io/klog/v2"

	"sigs.k8s.io/cluster-api-provider-openstack/pkg/scope"

	"github.com/sharedtransport/sharedtransport/capo/fakeopenstack"
)

// lockedBuffer is a bytes.Buffer safe for klog's concurrent writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	klog.Flush()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSharedScopeLogs: at -v=10 CAPO logs every OpenStack request and
// response (gophercloud's logging round tripper, from -v=5), and the
// library logs through klog too. Scopes of two credentials are built and
// used, through a scope cache and without one; no password and no token
// issued appears in a log line, as is and patched.
func TestSharedScopeLogs(t *testing.T) {
	var logged lockedBuffer
	flags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(flags)
	for name, value := range map[string]string{"v": "10", "logtostderr": "false", "alsologtostderr": "false", "stderrthreshold": "FATAL"} {
		if err := flags.Set(name, value); err != nil {
			t.Fatal(err)
		}
	}
	klog.SetOutput(&logged)
	defer func() {
		klog.Flush()
		flags.Set("v", "0")
		flags.Set("logtostderr", "true")
		klog.SetOutput(os.Stderr)
	}()

	users := passwords(2)
	s, err := fakeopenstack.Start(fakeopenstack.Options{Users: users})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, refs := credentials(s.URL, s.CA, 2)
	factory := scope.NewFactory(10)
	for range 2 {
		for i, ref := range refs {
			if err := reconcile(factory, c, ref, fmt.Sprintf("server-of-user%d", i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	rebuilt := scope.NewFactory(0)
	if err := reconcile(rebuilt, c, refs[0], "server-of-user0"); err != nil {
		t.Fatal(err)
	}

	out := logged.String()
	secrets := map[string]string{} // secret -> what it is, for the error, which must not print it
	for i, token := range s.Tokens() {
		secrets[token] = fmt.Sprintf("token %d issued", i+1)
	}
	for user, password := range users {
		secrets[password] = user + "'s password"
	}
	t.Logf("patched %v: %d lines logged at -v=10, %d tokens issued", patched, strings.Count(out, "\n"), len(s.Tokens()))
	if !strings.Contains(out, "/v3/auth/tokens") || len(s.Tokens()) < 3 {
		t.Fatalf("patched %v: the requests were not logged at -v=10 (%d tokens issued):\n%s", patched, len(s.Tokens()), out)
	}
	for secret, what := range secrets {
		if strings.Contains(out, secret) {
			t.Errorf("patched %v: the %s is in a log line at -v=10", patched, what)
		}
	}
}
