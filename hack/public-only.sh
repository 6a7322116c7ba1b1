#!/usr/bin/env bash
# Fails when the library (the root package, tests excluded) reads memory or
# unexported state of Go or client-go: unsafe, linkname, function pointers
# and closure words through reflect, symbol names, or client-go's unexported
# type names. What the library shows about a transport it shows through
# public behaviour only.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.go' | grep -v / | grep -v '_test\.go$')
pattern='"unsafe"|go:linkname|runtime\.FuncForPC|UnsafeAddr|UnsafePointer|\.Pointer\(\)|reflect\.ValueOf\([^)]*\)\.(Pointer|UnsafePointer)|NumMethod|MethodByName|FieldByName|dynamicClientCert|trackedTransport|atomicTransportHolder|connDialer|tlsCacheKey'
if found=$(grep -nE "$pattern" $files); then
	echo "the library must not read memory or unexported state (hack/public-only.sh):"
	echo "$found"
	exit 1
fi
echo "public behaviour only: ok"
