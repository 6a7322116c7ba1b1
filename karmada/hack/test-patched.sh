#!/usr/bin/env bash
# Builds Karmada v1.18.2 with karmada/patches applied (patched-karmada.sh:
# Karmada's own unit tests of the changed packages, before and after) and runs
# karmada/'s tests of Karmada's own code against it (TestOwn..., and the pool
# modes of TestSeedLoad and TestTLS12Refused): the module is replaced by
# the patched copy through a go.mod of its own (-modfile), and the build tag
# karmada_patched tells the tests which Karmada they run. The real
# kube-apiserver comes from KUBE_APISERVER and ETCD (e2e/hack/kube-apiserver.sh).
#
# With KARMADA_BUILD_ONLY=1 (see patched-karmada.sh) it compiles and runs
# nothing.
#
# Usage: karmada/hack/test-patched.sh [go test flags]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir="$here/.patched"
"$here/hack/patched-karmada.sh" "$dir"

work="$(mktemp -d "${TMPDIR:-/tmp}/karmada-patched-mod.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cd "$here"
go mod edit -replace=github.com/karmada-io/karmada="$dir" -print >"$work/go.mod"
cp go.sum "$work/go.sum"
go mod tidy -modfile="$work/go.mod" >/dev/null
go vet -modfile="$work/go.mod" -tags karmada_patched .
if [ "${KARMADA_BUILD_ONLY:-}" = 1 ]; then
	go test -modfile="$work/go.mod" -tags karmada_patched -c -o /dev/null .
	exit
fi
echo "== karmada/: Karmada's own code, patched, against the real kube-apiserver"
go test -modfile="$work/go.mod" -tags karmada_patched -count=1 -run '^TestOwn|^TestSeedLoad$|^TestTLS12Refused$' "$@" .
