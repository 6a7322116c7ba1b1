// Package capo is the pool's second adopter: Cluster API Provider OpenStack,
// whose controller builds an *http.Transport per credential scope and never
// closes it (CAPO issue 3227). capo/patches hold the change, against
// release v0.14.7 and against main, and PULL_REQUEST.md the pull request;
// capo/hack/test-capo.sh runs CAPO's own unit tests before and after it,
// then capo/testdata's tests inside CAPO's pkg/scope, as is and patched;
// fakeopenstack serves the Keystone and Nova CAPO's scopes talk to,
// counting connections on the server side, in this process or a child, and
// a proxy that knows its name; capo/hack/chart draws the load's chart.
package capo
