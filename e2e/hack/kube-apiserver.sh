#!/usr/bin/env bash
# Provides the binaries the end-to-end suite needs and prints where they are.
#
#   kube-apiserver: built from the k8s.io/kubernetes Go module (served by the Go
#     module proxy) and cached outside the repository, keyed by version:
#     ${SHAREDTRANSPORT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sharedtransport}/kube-apiserver-<version>
#   etcd: Debian's etcd-server package, installed with apt-get when `etcd` is
#     not on PATH.
#
# Usage: e2e/hack/kube-apiserver.sh [version]     (default v1.37.2)
# Prints "KUBE_APISERVER=<path>" and "ETCD=<path>" on stdout; logs go to stderr.
set -euo pipefail

K8S_VERSION="${1:-${KUBE_VERSION:-v1.37.2}}"
CACHE="${SHAREDTRANSPORT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sharedtransport}"
BIN="$CACHE/kube-apiserver-$K8S_VERSION"

log() { echo "kube-apiserver.sh: $*" >&2; }

ensure_etcd() {
	if command -v etcd >/dev/null 2>&1; then
		return
	fi
	log "etcd not found; installing Debian package etcd-server"
	local sudo=()
	if [ "$(id -u)" != 0 ]; then
		sudo=(sudo)
	fi
	export DEBIAN_FRONTEND=noninteractive
	"${sudo[@]}" apt-get update -qq >&2 || true
	"${sudo[@]}" apt-get install -y -qq etcd-server >&2
	# The package starts a system etcd on the default ports on some setups; the
	# suite uses its own free ports, so it is harmless, but stop it if we can.
	if command -v systemctl >/dev/null 2>&1; then
		"${sudo[@]}" systemctl stop etcd >/dev/null 2>&1 || true
	fi
	command -v etcd >/dev/null 2>&1 || { log "etcd still not on PATH after install"; exit 1; }
}

build_apiserver() {
	if [ -x "$BIN" ]; then
		log "reusing $BIN"
		return
	fi
	# Staging modules are published as v0.<minor>.<patch> for kubernetes v1.<minor>.<patch>.
	local staging_version="v0.${K8S_VERSION#v1.}"
	local start=$SECONDS
	log "downloading k8s.io/kubernetes@$K8S_VERSION"
	local dir
	dir="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
	[ -n "$dir" ] && [ -d "$dir" ] || { log "could not download k8s.io/kubernetes@$K8S_VERSION"; exit 1; }

	BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kube-apiserver-build.XXXXXX")"
	trap 'chmod -R u+w "$BUILD_DIR" 2>/dev/null; rm -rf "$BUILD_DIR"' EXIT
	local work="$BUILD_DIR"
	cp -r "$dir/." "$work/src"
	chmod -R u+w "$work/src"
	cd "$work/src"

	# Every module replaced by ./staging/... : drop the replace, require the
	# published version (only for modules the go.mod actually requires).
	local mods
	mods="$(go mod edit -json | sed -n 's/^[[:space:]]*"Path": "\(k8s.io\/[^"]*\)",\{0,1\}$/\1/p' | sort -u)"
	local replaced
	replaced="$(awk '/^replace \(/{r=1;next} r&&/^\)/{r=0} r&&/=> \.\/staging\//{print $1}' go.mod)"
	replaced="$replaced $(awk '/^replace k8s.io\/.* => \.\/staging\//{print $2}' go.mod)"
	local args=()
	for m in $replaced; do
		args+=("-dropreplace=$m")
		if grep -qE "^[[:space:]]+$m v0\.0\.0" go.mod; then
			args+=("-require=$m@$staging_version")
		fi
	done
	go mod edit "${args[@]}"
	log "building kube-apiserver $K8S_VERSION (staging modules at $staging_version); this takes minutes"
	local minor="${K8S_VERSION#v1.}"
	minor="${minor%%.*}"
	# No debug information: nothing reads it, and leaving it out shortens
	# the compile and the link of a large binary.
	local ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldflags="$ldflags -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
	done
	GOFLAGS=-mod=mod GOWORK=off CGO_ENABLED=0 go build -trimpath -gcflags=all=-dwarf=false -ldflags "$ldflags" -o "$BIN.tmp" ./cmd/kube-apiserver
	mv "$BIN.tmp" "$BIN"
	log "built $BIN in $((SECONDS - start))s"
}

# One caller at a time: a second one (.ci/run's e2e stage, while its
# background job builds) waits for the first, then reuses what it installed
# and built.
mkdir -p "$CACHE"
exec 9>"$CACHE/.kube-apiserver-$K8S_VERSION.lock"
if ! flock -n 9; then
	log "waiting for another call of kube-apiserver.sh to finish"
	flock 9
fi
ensure_etcd
build_apiserver
echo "KUBE_APISERVER=$BIN"
echo "ETCD=$(command -v etcd)"
