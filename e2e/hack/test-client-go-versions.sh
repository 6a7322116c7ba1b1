#!/usr/bin/env bash
# Runs the library's tests (the root package and internal/conns) against other
# client-go versions than the one the root go.mod requires (the oldest
# supported minor), in a temporary copy of the repository root (without e2e/),
# so the real go.mod is never touched.
#
# Usage: e2e/hack/test-client-go-versions.sh [client-go version[:norace]...]
#   (default: v0.37.2). A version marked :norace runs without the race
#   detector, for a client-go that races within itself.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
	versions=(v0.37.2)
fi

for spec in "${versions[@]}"; do
	v="${spec%%:*}"
	race=-race
	[ "$spec" != "$v:norace" ] || race=
	work="$(mktemp -d "${TMPDIR:-/tmp}/sharedtransport-clientgo-$v.XXXXXX")"
	trap 'rm -rf "$work"' EXIT
	# The module root minus e2e/ (a module of its own) and VCS metadata.
	tar -C "$root" --exclude=./e2e --exclude=./.git -cf - . | tar -C "$work" -xf -
	echo "== unit tests against k8s.io/client-go $v${race:+ with $race} (copy in $work)" >&2
	(
		cd "$work"
		export GOFLAGS=-mod=mod GOWORK=off
		go get "k8s.io/client-go@$v" "k8s.io/api@$v" "k8s.io/apimachinery@$v"
		go mod tidy
		go list -m k8s.io/client-go k8s.io/api k8s.io/apimachinery >&2
		# The library's packages: the test helpers' own tests are about the
		# helpers, and the library's code is vetted in the root module.
		go test $race -count=1 . ./internal/conns
	)
	rm -rf "$work"
	trap - EXIT
done
