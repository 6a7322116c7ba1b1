#!/usr/bin/env bash
# Runs the end-to-end suite against a real kube-apiserver and etcd.
#
# Builds (or reuses from the cache) kube-apiserver, installs etcd when missing,
# then runs the e2e module's tests with the race detector. Extra arguments go
# to `go test` (e.g. -run TestSeedLoad -v).
#
#   E2E_TIMEOUT   go test timeout (default 15m)
#   E2E_RACE=0    without the race detector (.ci/run: its Go 1.27 stage has
#                 compiled client-go v0.37.2 without it, and e2e reuses that)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$("$here/hack/kube-apiserver.sh")"
KUBE_APISERVER="$(sed -n 's/^KUBE_APISERVER=//p' <<<"$out")"
ETCD="$(sed -n 's/^ETCD=//p' <<<"$out")"
export KUBE_APISERVER ETCD
echo "e2e: kube-apiserver $KUBE_APISERVER, etcd $ETCD" >&2

cd "$here"
race=-race
[ "${E2E_RACE:-1}" != 0 ] || race=
exec go test $race -count=1 -timeout "${E2E_TIMEOUT:-15m}" "$@" ./...
