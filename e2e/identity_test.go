package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport"
)

// TestIdentities: three users, three connections (once each user's first
// request opened its own, the server accepts no other: a cold burst would
// dial as net/http dials), and the server sees each client as its own
// user. alice and carol use file paths, bob inline data.
func TestIdentities(t *testing.T) {
	c := cl(t)
	p := sharedtransport.New()
	defer closePool(t, p)
	relay := startTLSRelay(t, c.port)

	users := []struct {
		name   string
		inline bool
	}{{"alice", false}, {"bob", true}, {"carol", false}}
	clients := map[string]*kubernetes.Clientset{}
	for _, u := range users {
		cfg, err := p.BuildConfigFromFlags(relay.url(), c.kubeconfig(u.name, u.inline))
		if err != nil {
			t.Fatalf("%s: BuildConfigFromFlags: %v", u.name, err)
		}
		clients[u.name] = mustClientset(t, cfg)
		mustWhoami(t, clients[u.name], u.name)
	}

	// Each user, 30 concurrent clients x 5 SelfSubjectReviews, every client
	// from a fresh config of that user.
	errs, first := runWorkers(90, 5, func(worker, _ int) error {
		u := users[worker%len(users)]
		cfg, err := p.BuildConfigFromFlags(relay.url(), c.kubeconfig(u.name, u.inline))
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		got, err := whoami(ctx, cs)
		if err != nil {
			return err
		}
		if got != u.name {
			return fmt.Errorf("client of %s: server saw %q", u.name, got)
		}
		return nil
	})
	if errs > 0 {
		t.Errorf("%d of 450 SelfSubjectReviews failed, first: %v", errs, first)
	}
	for _, u := range users {
		mustWhoami(t, clients[u.name], u.name)
	}
	accepted, peak, _, _ := relay.counts()
	open := relay.open()
	stats := logStats(t, "pool", p)
	t.Logf("3 users: the server accepted %d connections, at most %d open at once, %d open", accepted, peak, open)
	if accepted != 3 || open != 3 {
		t.Errorf("3 users: the server accepted %d connections and %d are open, want 3 and 3", accepted, open)
	}
	if stats.Identities != 3 {
		t.Errorf("Stats.Identities = %d, want 3", stats.Identities)
	}
}

// TestCopySafety: a rest.CopyConfig of a wrapped config whose client
// certificate is changed after Wrap must reach the server as the new user,
// never ride the original identity's connections.
func TestCopySafety(t *testing.T) {
	c := cl(t)
	p := sharedtransport.New()
	defer closePool(t, p)
	bob := c.clients["bob"]

	for _, inline := range []bool{false, true} {
		name := "Files"
		if inline {
			name = "Inline"
		}
		t.Run(name, func(t *testing.T) {
			alice, err := p.BuildConfigFromFlags("", c.kubeconfig("alice", inline))
			if err != nil {
				t.Fatal(err)
			}
			aliceCS := mustClientset(t, alice)
			mustWhoami(t, aliceCS, "alice") // alice's connection is open and idle now

			cp := rest.CopyConfig(alice)
			cp.CertFile, cp.KeyFile = "", ""
			cp.CertData, cp.KeyData = bob.CertPEM, bob.KeyPEM
			mustWhoami(t, mustClientset(t, cp), "bob")

			// The other way round: wrap bob, copy, give the copy alice's files.
			bobCfg, err := p.BuildConfigFromFlags("", c.kubeconfig("bob", inline))
			if err != nil {
				t.Fatal(err)
			}
			mustWhoami(t, mustClientset(t, bobCfg), "bob")
			cp2 := rest.CopyConfig(bobCfg)
			cp2.CertData, cp2.KeyData = nil, nil
			cp2.CertFile, cp2.KeyFile = c.dir+"/pki/carol.crt", c.dir+"/pki/carol.key"
			mustWhoami(t, mustClientset(t, cp2), "carol")

			// The originals are unchanged.
			mustWhoami(t, aliceCS, "alice")
		})
	}
	logStats(t, "pool", p)
}
