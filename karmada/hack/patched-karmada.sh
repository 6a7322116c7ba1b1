#!/usr/bin/env bash
# Applies karmada/patches/*.patch to Karmada v1.18.2's own source (a copy of
# the module cache's, fetched from the module proxy if missing), and runs
# Karmada's own unit tests of the packages the patches touch, before and after
# the patches; after them it also builds and vets the Karmada packages and
# commands that use those packages. The patched copy is left in DIR (default:
# karmada/.patched), where karmada/'s TestPatchedKarmada finds it (see
# karmada/hack/test-patched.sh).
#
# With KARMADA_BUILD_ONLY=1 it compiles the tests instead of running them:
# .ci/run's background job fills the build cache that way for the run after.
#
# Usage: karmada/hack/patched-karmada.sh [DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/.." && pwd)"
dir="${1:-$here/.patched}"
version=v1.18.2

# The packages the patches change, and the cluster proxy's two callers (the
# aggregated apiserver's cluster storage, karmada-search's cluster plugin),
# whose own tests run before and after.
tested=(./pkg/util/proxy/ ./pkg/util/ ./pkg/registry/cluster/storage/ ./pkg/search/proxy/framework/plugins/cluster/)
# What uses them: the aggregated apiserver (the cluster proxy), karmada-search
# (its cluster plugin), the controller manager and the metrics adapter (the
# cluster client sets).
built=(./pkg/util/... ./pkg/registry/... ./pkg/search/... ./pkg/controllers/... ./pkg/metricsadapter/...
	./cmd/aggregated-apiserver/ ./cmd/karmada-search/ ./cmd/controller-manager/ ./cmd/metrics-adapter/)

bins="$(mktemp -d "${TMPDIR:-/tmp}/karmada-tests.XXXXXX")"
trap 'rm -rf "$bins"' EXIT
testing="go test"
[ "${KARMADA_BUILD_ONLY:-}" != 1 ] || testing="go test -c (compile only)"
run_tests() {
	if [ "${KARMADA_BUILD_ONLY:-}" = 1 ]; then
		go test -c -o "$bins/" "$@"
	else
		go test -count=1 "$@"
	fi
}

src="$(cd "$here" && go mod download -json "github.com/karmada-io/karmada@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[ -n "$src" ] && [ -d "$src" ] || { echo "patched-karmada: no source for github.com/karmada-io/karmada@$version"; exit 1; }
if [ -d "$dir" ]; then chmod -R u+w "$dir"; rm -rf "$dir"; fi
mkdir -p "$(dirname "$dir")"
cp -r "$src" "$dir"
chmod -R u+w "$dir"
cd "$dir"
# The module's vendor directory is incomplete (a module zip keeps only part of
# it): packages come from the module cache, as for karmada/'s own tests.
rm -rf vendor

echo "== Karmada $version as is: $testing ${tested[*]}"
run_tests "${tested[@]}"

echo "== applying karmada/patches"
for p in "$here"/patches/*.patch; do
	patch -p1 --no-backup-if-mismatch --forward <"$p" >/dev/null || { echo "patched-karmada: $(basename "$p") does not apply to Karmada $version"; exit 1; }
	echo "$(basename "$p"): +$(grep -c '^+[^+]' "$p") -$(grep -c '^-[^-]' "$p") lines"
done
go mod edit -require=github.com/sharedtransport/sharedtransport@v0.0.0 -replace=github.com/sharedtransport/sharedtransport="$root"
go mod tidy
echo "go.mod after the patches (what changed for Karmada's dependencies):"
diff <(sed -n '/^require (/,/^)/p' "$src/go.mod" | grep -v '// indirect') <(sed -n '/^require (/,/^)/p' go.mod | grep -v '// indirect') || true
grep '^go ' go.mod

echo "== Karmada $version patched: go build and go vet of what uses the changed packages"
go build "${built[@]}"
go vet ./pkg/util/proxy/ ./pkg/util/

echo "== Karmada $version patched: $testing ${tested[*]}"
run_tests "${tested[@]}"
