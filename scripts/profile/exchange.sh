#!/usr/bin/env bash
# Profiles where a Downpour job's CPU goes, by role and by part of the
# exchange (issue 26 for dense models, issue 38 for models with tables):
# runs a job for 30 s with nFetch = nPush = N (default 1; its target out of
# reach, nothing evaluated after the first 10 s), records every CPU with
# perf (cpu-clock, dwarf call graphs) for 4 s mid-run, and prints
# scripts/profile/classify.py's breakdown. Needs perf (Debian's linux-perf)
# and root or kernel.perf_event_paranoid <= -1.
#
# Usage: scripts/profile/exchange.sh [N] [JOB.yaml]
#   JOB defaults to examples/fashion-mnist-downpour.yaml; the sparse
#   examples (examples/adult-wide-deep.yaml, examples/synthetic-ctr.yaml)
#   are broken down by their own parts (keys, row lookup, Adagrad on rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
n=${1:-1}
job=${2:-examples/fashion-mnist-downpour.yaml}
out=$(mktemp -d)
bin=target/release/distbelief
[ -x "$bin" ] || cargo build --release -p distbelief
python3 - "$job" "$out/job.yaml" "$n" <<'PY'
import re, sys
src, dst, n = sys.argv[1:]
s = open(src).read()
s = re.sub(r"(?m)^(  name: )(\S+)", lambda m: f"{m.group(1)}profile-{m.group(2)}-{n}", s, count=1)
for key, value in [("nFetch", n), ("nPush", n), ("targetTestAccuracy", "0.999"),
                   ("targetTestAuc", "0.999"), ("maxSeconds", "30"),
                   ("evalIntervalSeconds", "10"), ("maxEpochs", "1000")]:
    s = re.sub(rf"(?m)^(\s+{key}: )\S+", rf"\g<1>{value}", s)
open(dst, "w").write(s)
PY
"$bin" train "$out/job.yaml" --out "$out/run" --summary-json "$out/summary.json" > "$out/train.log" 2>&1 &
train=$!
sleep 10
perf record -a --call-graph dwarf,16384 -e cpu-clock -F 499 -o "$out/perf.data" -- sleep 4 2>/dev/null
wait "$train" || { tail -n 20 "$out/train.log" >&2; exit 1; }
perf script -i "$out/perf.data" -F comm,pid,ip,sym 2>/dev/null > "$out/perf.txt"
python3 scripts/profile/classify.py "$out/perf.txt" "$out/run/processes.tsv" 4 "$out/summary.json" "$n"
echo "(raw data in $out)"
