#!/usr/bin/env bash
# The project's test command (README "Run the tests"): formatting, vet, the
# library and command tests under the race detector, the same tests against
# the newest client-go, and the end-to-end suite against a real kube-apiserver
# and etcd (built or installed on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change:"; echo "$unformatted"; exit 1
fi

echo "== go vet"
go vet ./...

echo "== go test -race ./..."
go test -race -count=1 -timeout 20m ./...

if [ "${SKIP_E2E:-}" = "1" ]; then
	echo "== SKIP_E2E=1: not running the client-go matrix and the kube-apiserver suite"
	exit 0
fi

if [ -x e2e/hack/test-client-go-versions.sh ]; then
	echo "== library tests against client-go v0.37"
	e2e/hack/test-client-go-versions.sh
fi

if [ -x e2e/run.sh ]; then
	echo "== end to end: real kube-apiserver and etcd"
	e2e/run.sh
fi
