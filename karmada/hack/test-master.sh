#!/usr/bin/env bash
# Tests the pull request on Karmada's master. From master's tree it runs,
# offline from master's vendor directory (-mod=vendor, GOPROXY=off),
# Karmada's own unit tests of the packages the patches touch and of the
# cluster proxy's callers, before and after karmada/patches/master/; builds
# the aggregated apiserver, karmada-search, the controller manager and the
# metrics adapter patched; then runs karmada/'s tests of Karmada's own code against master
# as is (every test, as CI runs them against v1.18.2) and patched (TestOwn...,
# the pool modes of TestSeedLoad and TestTLS12Refused, and the token rotation
# through master's own BuildClusterConfig). karmada/ is a module of its own:
# those take master's dependencies from the module proxy, and the real
# kube-apiserver from KUBE_APISERVER and ETCD (e2e/hack/kube-apiserver.sh).
#
# DIR is master's tree (go.mod, go.sum, pkg, cmd, vendor, operator, test,
# examples), or a git directory holding master (the snapshot `fetch` brings),
# whose HEAD is extracted (a snapshot may lack large files elsewhere, which
# git reports and which are not read). KARMADA_COMMIT names the commit when
# DIR is a tree. The copies are left in karmada/.master/{asis,patched}.
#
# Usage: karmada/hack/test-master.sh DIR [go test flags for karmada/'s tests]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/.." && pwd)"
src="$(cd "${1:?usage: test-master.sh DIR [go test flags]}" && pwd)"
shift
asis="$here/.master/asis"
dir="$here/.master/patched"

# As in patched-karmada.sh: the changed packages and the cluster proxy's two
# callers are tested; what uses them is built.
tested=(./pkg/util/proxy/ ./pkg/util/ ./pkg/registry/cluster/storage/ ./pkg/search/proxy/framework/plugins/cluster/)
built=(./pkg/util/... ./pkg/registry/... ./pkg/search/... ./pkg/controllers/... ./pkg/metricsadapter/...
	./cmd/aggregated-apiserver/ ./cmd/karmada-search/ ./cmd/controller-manager/ ./cmd/metrics-adapter/)

# What the packages built and tested import from master's tree.
tree=(go.mod go.sum pkg cmd vendor operator test examples)
if [ -d "$here/.master" ]; then chmod -R u+w "$here/.master"; rm -rf "$here/.master"; fi
mkdir -p "$asis"
if git --git-dir="$src" rev-parse --verify -q HEAD >/dev/null; then
	commit="$(git --git-dir="$src" rev-parse HEAD)"
	git --git-dir="$src" archive HEAD -- "${tree[@]}" | tar -x -C "$asis"
else
	commit="${KARMADA_COMMIT:-unknown}"
	for d in "${tree[@]}"; do cp -r "$src/$d" "$asis/"; done
fi
cp -r "$asis" "$dir"
cd "$dir"
echo "== Karmada master at $commit ($(sed -n 's/^go \([^ ]*\).*/go \1/p' go.mod), $(grep -m1 'k8s.io/client-go ' go.mod | xargs))"

offline() { GOFLAGS=-mod=vendor GOPROXY=off "$@"; }
# unit_tests runs Karmada's tests of the tested packages and counts the
# top-level tests that passed and failed.
unit_tests() {
	offline go test -count=1 -v "${tested[@]}" 2>&1 | awk '
		/^--- PASS/ { pass++ } /^--- FAIL/ { fail++; print } /^--- SKIP/ { skip++ }
		/^(ok|FAIL|panic)/ { print }
		END { printf "top-level tests: %d passed, %d failed, %d skipped\n", pass, fail, skip; exit (fail > 0 ? 1 : 0) }'
}

echo "== Karmada master as is: go test ${tested[*]}"
unit_tests

echo "== applying karmada/patches/master"
for p in "$here"/patches/master/*.patch; do
	patch -p1 --no-backup-if-mismatch --forward <"$p" >/dev/null || { echo "test-master: $(basename "$p") does not apply to Karmada master at $commit"; exit 1; }
	echo "$(basename "$p"): +$(grep -c '^+[^+]' "$p") -$(grep -c '^-[^-]' "$p") lines"
done
# The library joins master's vendor directory as a module of its own; its
# dependencies are master's, all vendored already.
lib=vendor/github.com/sharedtransport/sharedtransport
mkdir -p "$lib/internal/conns"
for f in "$root"/*.go "$root"/internal/conns/*.go; do
	case "$f" in *_test.go) continue ;; esac
	rel="${f#"$root"/}"
	cp "$f" "$lib/$rel"
done
cp "$root/LICENSE" "$lib/"
version=v0.0.0-00010101000000-000000000000
go mod edit -require="github.com/sharedtransport/sharedtransport@$version"
libgo="$(sed -n 's/^go //p' "$root/go.mod")"
printf '# github.com/sharedtransport/sharedtransport %s\n## explicit; go %s\ngithub.com/sharedtransport/sharedtransport\ngithub.com/sharedtransport/sharedtransport/internal/conns\n' \
	"$version" "$libgo" >>vendor/modules.txt

echo "== Karmada master patched: go build and go vet of what uses the changed packages"
offline go build "${built[@]}"
offline go vet ./pkg/util/proxy/ ./pkg/util/

echo "== Karmada master patched: go test ${tested[*]}"
unit_tests

# karmada_tests runs karmada/'s tests against the Karmada tree $1 with the
# build tags $2, through a go.mod of its own (-modfile).
work="$(mktemp -d "${TMPDIR:-/tmp}/karmada-master-mod.XXXXXX")"
trap 'rm -rf "$work"' EXIT
karmada_tests() {
	local tree="$1" tags="$2"
	shift 2
	mkdir -p "$work/$tags"
	go mod edit -replace=github.com/karmada-io/karmada="$tree" -print >"$work/$tags/go.mod"
	cp go.sum "$work/$tags/go.sum"
	go mod tidy -modfile="$work/$tags/go.mod" >/dev/null
	go vet -modfile="$work/$tags/go.mod" -tags "$tags" .
	go test -modfile="$work/$tags/go.mod" -tags "$tags" -count=1 "$@" .
}
cd "$here"
echo "== karmada/: Karmada's own code, master as is, against the real kube-apiserver"
karmada_tests "$asis" karmada_master "$@"
echo "== karmada/: Karmada's own code, master patched, against the real kube-apiserver"
karmada_tests "$dir" karmada_patched,karmada_master \
	-run '^TestOwn|^TestSeedLoad$|^TestTLS12Refused$|^TestTokenSourceRotation$' "$@"
