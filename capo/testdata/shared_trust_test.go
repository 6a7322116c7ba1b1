// What a scope trusts, as is and patched: capo/hack/test-capo.sh copies this
// file into CAPO's pkg/scope.

package scope_test

import (
	"context"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	infrav1 "sigs.k8s.io/cluster-api-provider-openstack/api/v1beta2"
	"sigs.k8s.io/cluster-api-provider-openstack/pkg/scope"

	"github.com/sharedtransport/sharedtransport/capo/fakeopenstack"
)

// TestSharedScopeTrust: the CA of a credential's Secret is what its next
// scope trusts: a cacert without the server's CA fails that scope at once,
// and the server's CA put back serves the next. A credential with
// verify: false is served without a CA, and a verifying scope whose CA does
// not match is refused after it, not carried over its connection.
func TestSharedScopeTrust(t *testing.T) {
	users := map[string]string{"alice": "alice-pass", "bob": "bob-pass"}
	s, err := fakeopenstack.Start(fakeopenstack.Options{Users: users})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	other, err := fakeopenstack.Start(fakeopenstack.Options{}) // its CA did not issue s's certificate
	if err != nil {
		t.Fatal(err)
	}
	other.Close()
	ctx := context.Background()
	secret := func(user string, ca []byte, insecure bool) *corev1.Secret {
		clouds := cloudsYAML(s.URL, user)
		if insecure {
			clouds = append(clouds, "    verify: false\n"...)
		}
		data := map[string][]byte{scope.CloudsSecretKey: clouds}
		if ca != nil {
			data[scope.CASecretKey] = ca
		}
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "clusters", Name: "cred-" + user}, Data: data}
	}
	ref := func(user string) credentialed {
		return credentialed{namespace: "clusters", ref: infrav1.OpenStackIdentityReference{Name: "cred-" + user, CloudName: "openstack"}}
	}
	c := fake.NewClientBuilder().WithObjects(secret("alice", s.CA, false), secret("bob", nil, true)).Build()
	factory := scope.NewFactory(0)

	if err := reconcile(factory, c, ref("alice"), "server-of-alice"); err != nil {
		t.Fatalf("alice with the server's CA: %v", err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(c.Update(ctx, secret("alice", other.CA, false)))
	_, err = factory.NewClientScopeFromObject(ctx, c, nil, logr.Discard(), ref("alice"))
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("alice's next scope with a CA that did not issue the server's certificate: %v, want a certificate error", err)
	}
	must(c.Update(ctx, secret("alice", s.CA, false)))
	if err := reconcile(factory, c, ref("alice"), "server-of-alice"); err != nil {
		t.Errorf("alice with the server's CA again: %v", err)
	}

	// bob does not verify the server; alice, with a CA that does not match,
	// still must.
	if err := reconcile(factory, c, ref("bob"), "server-of-bob"); err != nil {
		t.Fatalf("bob with verify: false: %v", err)
	}
	must(c.Update(ctx, secret("alice", other.CA, false)))
	if _, err := factory.NewClientScopeFromObject(ctx, c, nil, logr.Discard(), ref("alice")); err == nil {
		t.Errorf("alice with a CA that did not issue the server's certificate was served beside bob's verify: false")
	}
	t.Logf("patched %v: the server: %+v", patched, s.Counts())
}
