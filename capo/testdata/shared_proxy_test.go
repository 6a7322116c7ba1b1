// The environment's proxy, as is and patched: capo/hack/test-capo.sh copies
// this file into CAPO's pkg/scope.

package scope_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"sigs.k8s.io/cluster-api-provider-openstack/pkg/scope"

	"github.com/sharedtransport/sharedtransport/capo/fakeopenstack"
)

// The cloud's name only the proxy resolves: a scope that reaches it went
// through the proxy.
const proxiedHost = "openstack.fakeopenstack.test"

// proxyChildEnv carries the cloud's URL to the child process that runs the
// scopes with the proxy in its environment; its CA is in proxyChildCA.
const proxyChildEnv, proxyChildCA = "CAPO_TEST_PROXY_CHILD_URL", "CAPO_TEST_PROXY_CHILD_CA"

// TestSharedScopeProxy: CAPO's scopes take their proxy from the process's
// environment (HTTPS_PROXY, NO_PROXY), read once per process, so each case
// runs the scopes in a child process of this test binary. With HTTPS_PROXY
// every connection the cloud accepts came through a tunnel of the proxy;
// with the cloud's name also in NO_PROXY the scope dials it directly, which
// fails (only the proxy resolves the name) and opens no tunnel.
func TestSharedScopeProxy(t *testing.T) {
	if url := os.Getenv(proxyChildEnv); url != "" {
		proxyChild(t, url, []byte(os.Getenv(proxyChildCA)))
		return
	}
	s, err := fakeopenstack.Start(fakeopenstack.Options{Host: proxiedHost, Users: passwords(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := fakeopenstack.StartProxy(map[string]string{proxiedHost: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	run := func(noProxy string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestSharedScopeProxy$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), proxyChildEnv+"="+s.URL, proxyChildCA+"="+string(s.CA),
			"HTTPS_PROXY="+p.URL(), "https_proxy=", "NO_PROXY="+noProxy, "no_proxy=")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	out, err := run("")
	if err != nil || !strings.Contains(out, "--- PASS: TestSharedScopeProxy") {
		t.Fatalf("patched %v, HTTPS_PROXY set: the scopes in the child: %v\n%s", patched, err, out)
	}
	got := s.Counts()
	t.Logf("patched %v, HTTPS_PROXY set: %d tunnels; the cloud: %+v", patched, p.Tunnels(), got)
	if got.Accepted == 0 || int64(p.Tunnels()) != got.Accepted {
		t.Errorf("patched %v: the cloud accepted %d connections, the proxy opened %d tunnels; want every one through it", patched, got.Accepted, p.Tunnels())
	}

	tunnels := p.Tunnels()
	out, err = run(proxiedHost)
	if err == nil || !strings.Contains(out, "--- FAIL: TestSharedScopeProxy") {
		t.Errorf("patched %v, the cloud in NO_PROXY: the child %v, want its scope to fail, dialing a name only the proxy resolves\n%s", patched, err, out)
	}
	if p.Tunnels() != tunnels {
		t.Errorf("patched %v, the cloud in NO_PROXY: %d more tunnels, want none", patched, p.Tunnels()-tunnels)
	}
}

// proxyChild reconciles two clusters, each with its own credential, against
// the cloud at url, with the proxy of the environment the parent gave.
func proxyChild(t *testing.T, url string, ca []byte) {
	c, refs := credentials(url, ca, 2)
	factory := scope.NewFactory(0)
	for i, ref := range refs {
		if err := reconcile(factory, c, ref, "server-of-"+strings.TrimPrefix(ref.ref.Name, "cred-")); err != nil {
			t.Fatalf("cluster %d: %v", i, err)
		}
	}
}
