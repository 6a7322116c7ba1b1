#!/usr/bin/env bash
# Runs the library's tests of certificate files and Proxy configs against a
# client-go whose unexported structs carry fields no release has: a field in
# the certificate reloader (transport/cert_rotation.go) and one in the
# transport cache. The library reads nothing of client-go but what its APIs
# promise, so such a client-go must change nothing: no crash, the rotated
# certificate presented. Works in a temporary copy; the repository is not
# touched.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/sharedtransport-patched.XXXXXX")"
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
tar -C "$root" --exclude=./e2e --exclude=./karmada --exclude=./.git -cf - . | tar -C "$work" -xf -
cd "$work"
src="$(go list -m -f '{{.Dir}}' k8s.io/client-go)"
cp -r "$src" client-go
chmod -R u+w client-go
patch_field() { # file, line to follow, field to add
	local file="client-go/$1"
	grep -qF "$2" "$file" || { echo "patched-client-go: $1 has no line '$2' to patch"; exit 1; }
	awk -v after="$2" -v add="$3" '{ print } index($0, after) == 1 && !done { print add; done = 1 }' "$file" >"$file.new"
	mv "$file.new" "$file"
}
patch_field transport/cert_rotation.go $'\treload     reloadFunc' $'\trefreshed  time.Duration // not in any client-go release'
patch_field transport/cache.go $'\tmu         sync.Mutex' $'\tpadding    [3]uintptr // not in any client-go release'
go mod edit -replace k8s.io/client-go=./client-go
go mod tidy >/dev/null
echo "== library tests against k8s.io/client-go $(go list -m -f '{{.Version}}' k8s.io/client-go) with extra unexported fields" >&2
go test -count=1 -run 'TestRotationFilesProxyBadKey|TestRotationKinds|TestCopyCrossings|TestAdversaryRejectedCAFile' .
# A files + Proxy client across a torn rotation: no request may fail (issue 36).
go test -count=5 -run 'TestRotationFilesProxyNoLostRequest' .
