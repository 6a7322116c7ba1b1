#!/usr/bin/env bash
# Reruns every table of docs/measurements.md and rewrites the file: conncount's
# default table and its chart (seed-load.svg, beside the file), its second
# mode set, conncount proxy, and the root package's benchmarks, each with the
# command that produced it, the machine, its load, the Go version, the commit
# and the wall time.
#
#   hack/measure.sh            # full size (the numbers the docs quote)
#   MEASURE_SMALL=1 hack/measure.sh   # reduced sizes, to try the script
#
# Everything runs one step after another: the connection counts and CPU
# figures of one step must not share the machine with another step.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

out=${MEASURE_OUT:-docs/measurements.md}
if [ "${MEASURE_SMALL:-}" = 1 ]; then
	cc_size=(--workers 10 --requests 3 --repeat 1)
	bt_n=100x bt_seed=100x bt_burst=2x bt_count=1
else
	cc_size=(--repeat 5)
	bt_n=5000x bt_seed=1000x bt_burst=10x bt_count=5
fi
# TODO(lead): add the Karmada mode of conncount proxy (issue 26) to this list.
proxy_modes=new-transport,new-transport-keepalive-off,sharedtransport,sharedtransport-keepalive-off
second_modes=client-go,sharedtransport-wrap,client-go-keepalive-off,sharedtransport-keepalive-off,sharedtransport-keepalive-off-no-resumption

work=$(mktemp -d)
log="$work/log"
trap 'rm -rf "$work"' EXIT
trap 'echo "hack/measure.sh: a step failed; its stderr ends:" >&2; tail -n 40 "$log" >&2' ERR
started=$(date -u +%s)
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

step() { echo "== $*" >&2; }
elapsed() { echo "$(( $(date -u +%s) - $1 )) s"; }

step "build conncount and the root package's test binary"
go -C cmd/conncount build -o "$work/conncount" .
go test -c -o "$work/st.test" .

# conncount NAME ARGS...: runs conncount from cmd/conncount (as go -C does),
# keeps its table in $work/NAME and its wall time in $work/NAME.time.
conncount() {
	local name=$1 t0 sub=()
	shift
	if [ "${1:-}" = proxy ]; then sub=(proxy); shift; fi
	step "conncount ${sub[*]} $*"
	t0=$(date -u +%s)
	(cd cmd/conncount && "$work/conncount" "${sub[@]}" --progress=false "$@") >"$work/$name" 2>>"$log"
	elapsed "$t0" >"$work/$name.time"
}

# bench NAME BENCHTIME COUNT REGEXP: runs the benchmarks matching REGEXP.
bench() {
	local name=$1 bt=$2 count=$3 re=$4 t0
	step "benchmarks $re -benchtime $bt -count $count"
	t0=$(date -u +%s)
	# A failing benchmark does not stop the run: its output goes on the page
	# with the failure, and the script exits non-zero at the end.
	if ! "$work/st.test" -test.run '^$' -test.bench "$re" -test.benchtime "$bt" -test.count "$count" \
		-test.benchmem >"$work/$name" 2>>"$log"; then
		failed+=("$re")
	fi
	elapsed "$t0" >"$work/$name.time"
}
failed=()

# The seed's load as a picture, from the default table's runs: open
# connections over time for client-go's best case, client-go with Proxy,
# Karmada's keep-alive off and the pool.
chart_modes=client-go,client-go-proxy,client-go-keepalive-off,sharedtransport
conncount cc-default "${cc_size[@]}" --svg "$work/seed-load.svg" --svg-modes "$chart_modes"
conncount cc-second "${cc_size[@]}" --modes "$second_modes"
conncount cc-proxy proxy "${cc_size[@]}" --modes "$proxy_modes" --scrape
bench b-roundtrip "$bt_n" "$bt_count" '^BenchmarkRoundTrip$'
bench b-wrap "$bt_n" "$bt_count" '^BenchmarkWrap$'
bench b-transportfor "$bt_n" "$bt_count" '^BenchmarkTransportFor$'
bench b-seedload "$bt_seed" 3 '^BenchmarkSeedLoad$'
bench b-coldstart "$bt_burst" 2 '^BenchmarkColdStartBurst$'
bench b-churn 2000x 1 '^BenchmarkIdentityChurn$'
bench b-rotation 1x 1 '^BenchmarkRotationLatency$'
bench b-files 1x 3 '^BenchmarkFileIdentities$'

wall=$(elapsed "$started")
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

# benchtable FILE [BASE [PAIRS]]: the benchmarks of FILE as a Markdown table,
# one row per benchmark, one column per unit, each cell the median over
# -count runs. BASE is the last name segment of the baseline a row is
# compared with (the row with the same prefix); PAIRS ("a=b;c=d") names the
# baseline of particular last segments instead. Each compared cell shows
# the ratio of the medians, as benchstat does.
benchtable() {
	awk -v base="${2:-}" -v pairs="${3:-}" '
	function median(key,   n, i, j, v, t) {
		n = cnt[key]
		for (i = 1; i <= n; i++) v[i] = val[key, i]
		for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j-1] > v[j]; j--) { t = v[j]; v[j] = v[j-1]; v[j-1] = t }
		return n % 2 ? v[(n+1)/2] : (v[n/2] + v[n/2+1]) / 2
	}
	function fmt(x) { return x >= 1000 ? sprintf("%.0f", x) : sprintf("%.3g", x) }
	BEGIN {
		np = split(pairs, pl, ";")
		for (i = 1; i <= np; i++) { split(pl[i], kv, "="); pair[kv[1]] = kv[2] }
	}
	/^Benchmark/ {
		name = $1; sub(/-[0-9]+$/, "", name); sub(/^Benchmark/, "", name)
		if (!(name in seen)) { seen[name] = 1; names[++nn] = name }
		for (i = 3; i + 1 <= NF; i += 2) {
			u = $(i+1)
			if (!(u in useen)) { useen[u] = 1; units[++nu] = u }
			k = name SUBSEP u
			val[k, ++cnt[k]] = $i + 0
		}
	}
	END {
		if (nn == 0) { print "(no benchmark output)"; exit }
		printf "| benchmark |"; for (j = 1; j <= nu; j++) printf " %s |", units[j]; print ""
		printf "| --- |"; for (j = 1; j <= nu; j++) printf " --- |"; print ""
		for (i = 1; i <= nn; i++) {
			name = names[i]; last = name; sub(/.*\//, "", last); prefix = substr(name, 1, length(name) - length(last))
			b = ""
			if (last in pair) b = prefix pair[last]
			else if (base != "" && last != base) b = prefix base
			if (b != "" && !(b in seen)) b = ""
			printf "| %s |", name
			for (j = 1; j <= nu; j++) {
				k = name SUBSEP units[j]
				if (!(k in cnt)) { printf " |"; continue }
				m = median(k); cell = fmt(m)
				bk = b SUBSEP units[j]
				if (b != "" && (bk in cnt)) {
					bm = median(bk)
					if (bm != 0) cell = cell sprintf(" (%.2fx)", m / bm)
				}
				printf " %s |", cell
			}
			print ""
		}
	}' "$1"
}

# block FILE: a file as a fenced block.
block() { echo '```'; cat "$1"; echo '```'; }

# raw FILE: the go test output of FILE, folded; open, with a warning, when
# a benchmark in it failed.
raw() {
	if grep -q -e '^--- FAIL' -e '^FAIL' "$1"; then
		printf '\n**A benchmark of this section failed; its rows are missing above.**\n\n<details open><summary>go test output</summary>\n\n'
	else
		printf '\n<details><summary>go test output</summary>\n\n'
	fi
	block "$1"
	printf '\n</details>\n'
}

commit=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then commit="$commit (with uncommitted changes)"; fi
sizes="full sizes" title=""
[ "${MEASURE_SMALL:-}" = 1 ] && title=" (generated with reduced sizes; regenerate with hack/measure.sh)" && sizes="**reduced sizes** (MEASURE_SMALL=1): these figures show that the script works, not what the library costs; regenerate with \`hack/measure.sh\`"
goos_cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')

tmp="$work/measurements.md"
{
cat <<EOF
# Measurements$title

<!-- Generated by hack/measure.sh; do not edit by hand: rerun the script. -->

Generated by \`hack/measure.sh\` with $sizes.

| | |
| --- | --- |
| date | $(date -u +'%Y-%m-%d %H:%M UTC') |
| commit | $commit |
| Go | $(go version | cut -d' ' -f3-) |
| machine | $(nproc) CPUs, $goos_cpu |
| load average (1, 5, 15 min) | $load_start at the start, $load_end at the end |
| wall time of the whole run | $wall |

Compare ratios within one table, not absolute figures across runs: the
machine may be shared, and every table says how long it took. Connections
and handshakes are counted by the server (or the proxy), never by the
library; CPU is each process's own (getrusage over the load).

## The seed's load: conncount's default table

The seed's load (at full size 100 workers x 20 requests), a fresh \`rest.Config\` and clientset per request,
against an embedded TLS server (HTTP/2, 100 streams per connection,
client-certificate auth) in a process of its own, fresh for every run; every
run of a mode has a fresh client process. Each figure is the median of the
rounds, with its range. Modes: client-go as is (configs it can cache: its
best case), with \`Proxy\` set (as Karmada's member configs), Karmada's fix
(keep-alive off), the pool through \`HTTPClientFor\` with \`Proxy\` set, with keep-alive
off, and through \`Wrap\` without \`Proxy\` (\`Wrap\` passes a config with one through),
and the floors: one \`http.Client\` for every config, and one \`WrapTransport\` hook that returns one round tripper for every config, measuring sticks. Wall time: $(cat "$work/cc-default.time").

\`\`\`sh
go -C cmd/conncount run . ${cc_size[*]} --svg seed-load.svg --svg-modes $chart_modes
\`\`\`

![Open connections over time under the seed's load, counted by the server, on a logarithmic axis: client-go's best case, client-go with Proxy, Karmada's keep-alive off and the pool](seed-load.svg)

EOF
block "$work/cc-default"
cat <<EOF

## Keep-alive off and session resumption: conncount's second mode set

The same load: client-go's best case beside the pool without \`Proxy\` (both
caches hit), and keep-alive off three ways: Karmada's, the pool's with TLS
session resumption, and the pool's without it. Wall time: $(cat "$work/cc-second.time").

\`\`\`sh
go -C cmd/conncount run . ${cc_size[*]} --modes $second_modes
\`\`\`

EOF
block "$work/cc-second"
cat <<EOF

## The seed's own scenario: conncount proxy

Clients send requests through a Karmada-style aggregated-apiserver front
(\`internal/memberproxy\`: a \`rest.Config\` per proxied request from the
member's Secret data) to 3 member servers: member-1 and member-3
authenticate the front by client certificate, member-2 by token, and
member-3 is reached through a CONNECT proxy that answers 407 without the
member's \`Proxy-Authorization\` header. The members, the proxy, the front and
the load each run in fresh processes per run. After the tables: the pool's
\`Identities()\` beside what each member counted, and the Prometheus scrape of
each pool mode's last run. Wall time: $(cat "$work/cc-proxy.time").

\`\`\`sh
go -C cmd/conncount run . proxy ${cc_size[*]} --modes $proxy_modes --scrape
\`\`\`

EOF
block "$work/cc-proxy"
cat <<EOF

## Benchmarks

The root package's benchmarks (\`bench_test.go\`, \`entry_churn_test.go\`,
\`bench_linux_test.go\`), each run on its own. A cell is the median over
\`-count\` runs; "(0.95x)" is the ratio of that median to the baseline's, run
in the same invocation: the row the benchmark names as client-go's (or
net/http's) way of doing the same thing.

### Per request: BenchmarkRoundTrip

A request to a local server through a bare \`http.Transport\` built as
client-go builds one (the baseline) and through the pool's round tripper;
client-go's whole stack for a config alone and over the pool; and the pool's
layer alone over a base that does nothing, beside that base. Wall time:
$(cat "$work/b-roundtrip.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkRoundTrip\$' -benchtime $bt_n -count $bt_count -benchmem .
\`\`\`

EOF
benchtable "$work/b-roundtrip" "" "pool=http.Transport;client-go_stack_over_the_pool=client-go_stack;pool,_no-op_base=http.Transport,_no-op_base"
raw "$work/b-roundtrip"
cat <<EOF

### Per config: BenchmarkWrap and BenchmarkTransportFor

\`Wrap\` of a config whose identity exists (client-go has no counterpart, so
no ratio). Then a round tripper per config, the identity existing:
\`rest.TransportFor\` alone (the baseline: a cache hit for inline and file
material, a new transport with a \`Proxy\`), \`Wrap\` then \`rest.TransportFor\`,
and the pool's \`TransportFor\`. Wall time: $(cat "$work/b-wrap.time") and
$(cat "$work/b-transportfor.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkWrap\$' -benchtime $bt_n -count $bt_count -benchmem .
go test -run '^\$' -bench '^BenchmarkTransportFor\$' -benchtime $bt_n -count $bt_count -benchmem .
\`\`\`

EOF
benchtable "$work/b-wrap"
echo
benchtable "$work/b-transportfor" rest.TransportFor
raw "$work/b-wrap"
raw "$work/b-transportfor"
cat <<EOF

### The seed's load in-process: BenchmarkSeedLoad

One request per operation through a fresh config from a kubeconfig file, with
\`Proxy\` set, and a fresh clientset, from parallel goroutines; client-go
alone is the baseline. Wall time: $(cat "$work/b-seedload.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkSeedLoad\$' -benchtime $bt_seed -count 3 -benchmem .
\`\`\`

EOF
benchtable "$work/b-seedload" client-go
raw "$work/b-seedload"
cat <<EOF

### Cold start: BenchmarkColdStartBurst

300 concurrent first requests through a new client, server latency 20 ms;
client-go alone is the baseline; the pool also while the identity's first
request is a list the server takes 500 ms over. Per operation (one burst):
connections accepted, peak open, p99 latency. Wall time: $(cat "$work/b-coldstart.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkColdStartBurst\$' -benchtime $bt_burst -count 2 -benchmem .
\`\`\`

EOF
benchtable "$work/b-coldstart" client-go
raw "$work/b-coldstart"
cat <<EOF

### Memory per identity: BenchmarkIdentityChurn

Heap held per live identity, what is left per identity once all are dropped,
and the share of identities not released; client-go alone with configs it
caches is the baseline. Wall time: $(cat "$work/b-churn.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkIdentityChurn\$' -benchtime 2000x -benchmem .
\`\`\`

EOF
benchtable "$work/b-churn" "client-go_alone,_cacheable"
raw "$work/b-churn"
cat <<EOF

### Rotation latency: BenchmarkRotationLatency

From a write completing to the first request the server sees with the new
certificate, 20 rotations of each kind, requests at 100/s (b.N is ignored).
client-go alone re-reads certificate files every 5 minutes
(\`transport/cert_rotation.go\`); there is no baseline to run. Wall time:
$(cat "$work/b-rotation.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkRotationLatency\$' -benchtime 1x .
\`\`\`

EOF
benchtable "$work/b-rotation"
raw "$work/b-rotation"
cat <<EOF

### Many file identities: BenchmarkFileIdentities (Linux)

2,000 identities whose certificate, key and CA files lie in directories of
their own: \`Wrap\` that builds each, heap per live identity, and one poll of
all of them when nothing changed (b.N is ignored). Wall time:
$(cat "$work/b-files.time").

\`\`\`sh
go test -run '^\$' -bench '^BenchmarkFileIdentities\$' -benchtime 1x -count 3 .
\`\`\`

EOF
benchtable "$work/b-files"
raw "$work/b-files"
} >"$tmp"

mkdir -p "$(dirname "$out")"
mv "$work/seed-load.svg" "$(dirname "$out")/seed-load.svg"
mv "$tmp" "$out"
step "wrote $out in $wall"
if [ ${#failed[@]} -gt 0 ]; then
	echo "hack/measure.sh: benchmarks failed (their output is in $out): ${failed[*]}" >&2
	exit 1
fi
