#!/usr/bin/env bash
# Draws karmada/seed-load.svg, the chart karmada/PULL_REQUEST.md shows: open
# tunnels over time under the seed's load through Karmada v1.18.2's own
# ConnectCluster, as is and patched (TestOwnConnectClusterSeedLoad, run by
# the module's tests and then by test-patched.sh, keeps each run's samples in
# KARMADA_SEED_CHART and draws them all).
#
# Usage: karmada/hack/chart.sh   (KUBE_APISERVER and ETCD as for the tests;
#        without them, e2e/hack/kube-apiserver.sh provides both)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${KUBE_APISERVER:-}" ] || [ -z "${ETCD:-}" ]; then
	bins="$("$here/../e2e/hack/kube-apiserver.sh")"
	KUBE_APISERVER="$(sed -n 's/^KUBE_APISERVER=//p' <<<"$bins")"
	ETCD="$(sed -n 's/^ETCD=//p' <<<"$bins")"
	export KUBE_APISERVER ETCD
fi
KARMADA_SEED_CHART="$(mktemp -d "${TMPDIR:-/tmp}/karmada-chart.XXXXXX")"
export KARMADA_SEED_CHART
trap 'rm -rf "$KARMADA_SEED_CHART"' EXIT
run='^TestOwnConnectClusterSeedLoad$'
(cd "$here" && go test -count=1 -run "$run" -v . | grep -v '^=== ')
"$here/hack/test-patched.sh" -run "$run" -v | grep -v '^=== \|^go: downloading'
cp "$KARMADA_SEED_CHART/seed-load.svg" "$here/seed-load.svg"
echo "wrote $here/seed-load.svg"
