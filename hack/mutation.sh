#!/usr/bin/env bash
# Mutation testing of the identity, hook and connection code with gremlins
# (not run in CI: each mutant builds and runs the focused test set, tens of
# seconds on a shared 2-core machine).
#
# The focused set is chosen by the mutation build tag (mutation_test.go):
# the security- and connection-critical tests, in -short mode.
#
# Usage: hack/mutation.sh [file.go ...]
#   (default: wrapper.go sharedtransport.go entry.go identity.go;
#   MUTATION_WORKERS sets gremlins' parallel test runs, default 1)
# Results: gremlins' summary on stdout, per-mutant JSON in
# $MUTATION_OUT/mutation-<file>.json (MUTATION_OUT defaults to the module root).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v gremlins >/dev/null || go install github.com/go-gremlins/gremlins/cmd/gremlins@v0.6.0
# gremlins times each mutant's test run against its coverage run: a coverage
# run served from the test cache would time every mutant out.
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-count=1"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(wrapper.go sharedtransport.go entry.go identity.go)
for f in "${files[@]}"; do
	# Mutate f alone: every other Go file of the module, and every file in a
	# subdirectory (cmd, internal, metrics, e2e, hack), is excluded.
	excludes=(-E '/')
	for g in $(git ls-files '*.go' | grep -v / | grep -v '_test\.go$'); do
		[ "$g" = "$f" ] || excludes+=(-E "^${g//./\\.}\$")
	done
	echo "== $f"
	# No --test-cpu: gremlins v0.6.0 passes it to go test as the single
	# argument "-cpu N", which the test binary rejects, so every mutant
	# would be reported killed.
	gremlins unleash --tags mutation --workers "${MUTATION_WORKERS:-1}" --timeout-coefficient 4 \
		"${excludes[@]}" -o "${MUTATION_OUT:-.}/mutation-${f%.go}.json" .
done
