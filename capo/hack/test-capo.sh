#!/usr/bin/env bash
# Applies capo/patches to Cluster API Provider OpenStack's own source and runs
# CAPO's unit tests of pkg/scope and pkg/clients before and after the patch
# (top-level tests passed and failed, both times); patched, it also builds the
# manager and vets pkg/scope. Then capo/'s own tests of CAPO's code
# (capo/testdata, copied into CAPO's pkg/scope) run as is and patched (build
# tag capo_patched). The module proxy does not serve CAPO's module:
# DIR is a CAPO tree, or the git directory of its repository (a snapshot of
# kubernetes-sigs/cluster-api-provider-openstack), and REF a tag or commit in
# it (default: main for a git directory, the tree as it is otherwise). The
# patch set is the one that applies: capo/patches (release v0.14.7) or
# capo/patches/main. The library comes from this checkout (a replace).
# With CAPO_CHART set to a file, the load's connections over time, as is and
# patched, are drawn there (capo/scope-load.svg, the pull request's chart).
#
# Usage: [CAPO_CHART=capo/scope-load.svg] capo/hack/test-capo.sh DIR [REF]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/.." && pwd)"
src="${1:?usage: capo/hack/test-capo.sh DIR [REF]: DIR is a CAPO tree or the git directory of its repository}"
ref="${2:-}"
chart="${CAPO_CHART:+$(realpath -m "$CAPO_CHART")}"
work="$(mktemp -d "${TMPDIR:-/tmp}/capo.XXXXXX")"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
tree="$work/capo"
mkdir "$tree"
export CAPO_LOAD_CHART="$work/chart"
mkdir "$CAPO_LOAD_CHART"

if [ ! -f "$src/go.mod" ] && git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
	ref="${ref:-main}"
	git -C "$src" archive "$ref" | tar -x -C "$tree"
	described="$ref ($(git -C "$src" rev-parse --short=8 "$ref^{commit}"))"
elif [ -n "$ref" ]; then
	git -C "$src" archive "$ref" | tar -x -C "$tree"
	described="$ref ($(git -C "$src" rev-parse --short=8 "$ref^{commit}"))"
elif [ -f "$src/go.mod" ]; then
	cp -r "$src/." "$tree/"
	described="the tree in $src"
fi
grep -qs '^module sigs.k8s.io/cluster-api-provider-openstack$' "$tree/go.mod" ||
	{ echo "test-capo: $src${ref:+ at $ref} is not Cluster API Provider OpenStack (go.mod)"; exit 1; }
cd "$tree"

# The release's patches for a release tag, main's otherwise; the other set
# where the first does not apply.
sets=("$here/patches/main" "$here/patches")
case "$ref" in v[0-9]*) sets=("$here/patches" "$here/patches/main") ;; esac
patches=""
for set in "${sets[@]}"; do
	ok=1
	for p in "$set"/*.patch; do
		patch -p1 --dry-run --forward --silent <"$p" >/dev/null 2>&1 || ok=0
	done
	if [ "$ok" = 1 ]; then patches="$set"; break; fi
done
[ -n "$patches" ] || { echo "test-capo: neither capo/patches nor capo/patches/main applies to CAPO $described"; exit 1; }

tests=(./pkg/scope/... ./pkg/clients/...)
# run_tests LABEL: CAPO's own tests; prints the top-level tests passed and
# failed, and keeps the failed ones' names in $work/LABEL.failed.
run_tests() {
	local out="$work/$1.out"
	go test -mod=mod -count=1 -v "${tests[@]}" >"$out" 2>&1 || true
	grep -E '^--- FAIL: ' "$out" | awk '{print $3}' | sort >"$work/$1.failed" || true
	local passed failed broken
	passed=$(grep -cE '^--- PASS: ' "$out" || true)
	[ "$passed" != 0 ] || { echo "CAPO's own tests, $1: none ran"; tail -20 "$out"; return 1; }
	failed=$(wc -l <"$work/$1.failed")
	broken=$(grep -cE '^FAIL[[:space:]].*\[(build failed|setup failed)\]' "$out" || true)
	echo "CAPO's own tests, $1: $passed passed, $failed failed, $broken packages that did not build"
	if [ "$failed" != 0 ] || [ "$broken" != 0 ]; then grep -E '^(--- FAIL|FAIL|ok )' "$out" | head -40; fi
	[ "$broken" = 0 ]
}

echo "== CAPO $described as is: go test ${tests[*]}"
run_tests "as-is"

cp go.mod "$work/go.mod.as-is"
# capo/'s tests run inside CAPO's module, with this checkout's two modules.
go mod edit -require=github.com/sharedtransport/sharedtransport@v0.0.0-00010101000000-000000000000 \
	-replace=github.com/sharedtransport/sharedtransport="$root" \
	-require=github.com/sharedtransport/sharedtransport/capo@v0.0.0-00010101000000-000000000000 \
	-replace=github.com/sharedtransport/sharedtransport/capo="$here"
api="$(sed -n 's/^[[:space:]]*infrav1 "\(.*\)"$/\1/p' pkg/scope/provider.go)"
ours=()
copy_ours() {
	for f in "$here"/testdata/*_test.go; do
		sed "s|sigs.k8s.io/cluster-api-provider-openstack/api/v1beta2|$api|" "$f" >"pkg/scope/zz_sharedtransport_$(basename "$f")"
		ours+=("pkg/scope/zz_sharedtransport_$(basename "$f")")
	done
}
copy_ours
# A new requirement has the go command read the go.mod of every module in
# CAPO's graph. The proxy refuses some that no package built here uses
# (v0.14.7: sigs.k8s.io/cluster-api/test v1.12.10, for CAPO's e2e tests):
# each is replaced by an empty module of its path, which lowers no version
# CAPO's go.mod selects.
for _ in 1 2 3 4 5 6 7 8; do
	go list -mod=mod -deps -test ./pkg/scope/ . >/dev/null 2>"$work/list.err" && break
	refused="$(sed -n 's/^go: \([^ @]*\)@\([^:]*\): reading .*\.mod: 40[34] .*/\1 \2/p' "$work/list.err" | head -1)"
	[ -n "$refused" ] || { cat "$work/list.err"; exit 1; }
	read -r path version <<<"$refused"
	stub="$work/unserved/$path"
	mkdir -p "$stub"
	printf 'module %s\n\ngo 1.22\n' "$path" >"$stub/go.mod"
	go mod edit -replace="$path@$version=$stub"
	echo "$path $version: not served by the module proxy; an empty module stands in (no package of it is built)"
done
echo "== capo/'s tests of CAPO $described as is"
go test -mod=mod -count=1 -v -run '^TestShared' ./pkg/scope/ 2>&1 | grep -v '^=== ' | tee "$work/ours-as-is.out"
grep -q '^ok' "$work/ours-as-is.out"
rm -f "${ours[@]}"
ours=()

echo "== applying ${patches#"$root"/}"
for p in "$patches"/*.patch; do
	patch -p1 --forward --silent <"$p"
	echo "$(basename "$p"): +$(grep -c '^+[^+]' "$p") -$(grep -c '^-[^-]' "$p") lines"
done

echo "== CAPO $described patched: go test ${tests[*]}"
run_tests "patched"
if [ -n "$(comm -13 "$work/as-is.failed" "$work/patched.failed")" ]; then
	echo "test-capo: tests that passed as is fail patched: $(comm -13 "$work/as-is.failed" "$work/patched.failed" | tr '\n' ' ')"
	exit 1
fi
echo "== go.mod, as is -> patched: requirements added or raised"
requires() { awk '/^require \(/ {r = 1; next} /^\)/ {r = 0} r {print $1, $2} /^require [^(]/ {print $2, $3}' "$1" | sort; }
comm -13 <(requires "$work/go.mod.as-is") <(requires go.mod) | grep -v '^github.com/sharedtransport/sharedtransport/capo ' || true
echo "(and github.com/sharedtransport/sharedtransport/capo, for capo/'s tests only)"
echo "== CAPO patched: go vet ./pkg/scope/, go build (the manager)"
go vet -mod=mod ./pkg/scope/
go build -mod=mod -o "$work/manager" .
echo "manager built: $(du -h "$work/manager" | cut -f1)"

echo "== capo/'s tests of CAPO $described patched"
copy_ours
go test -mod=mod -count=1 -v -tags capo_patched -run '^TestShared' ./pkg/scope/ 2>&1 | grep -v '^=== ' | tee "$work/ours-patched.out"
grep -q '^ok' "$work/ours-patched.out"

if [ -n "$chart" ]; then
	caption="50 clusters, 100 workers x 20 reconciles, tokens of 2 s, --scope-cache-max-size=10; CAPO $described; sharedtransport $(git -C "$root" rev-parse --short HEAD)"
	(cd "$here" && go run ./hack/chart "$caption" "$CAPO_LOAD_CHART"/{as-is,patched}_--scope-cache-max-size10_HTTP{2,1.1}.json) >"$chart"
	echo "wrote $chart"
fi
