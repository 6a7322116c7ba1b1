// Package e2e is the end-to-end suite of sharedtransport: it runs the library
// against a real kube-apiserver and etcd started on loopback by the tests.
//
// The binaries are not part of the repository. Build or reuse them with
//
//	e2e/hack/kube-apiserver.sh
//
// which caches kube-apiserver under ${XDG_CACHE_HOME:-$HOME/.cache}/sharedtransport
// and installs Debian's etcd-server when etcd is missing; e2e/run.sh does that
// and runs the suite. The tests read KUBE_APISERVER and ETCD from the
// environment when set, and otherwise look in the cache and on PATH; when
// they are missing the suite fails and says how to build them. E2E_KEEP=1
// keeps the temporary directory (certificates, kubeconfigs, server logs).
package e2e
