#!/usr/bin/env bash
# Profiles where an exchange's CPU goes (issue 26): runs the Fashion-MNIST
# example for 30 s with nFetch = nPush = N (default 1; nothing evaluated
# after the first 10 s), records every CPU with perf (cpu-clock, dwarf call
# graphs) for 4 s mid-run, and prints scripts/profile/classify.py's
# breakdown. Needs perf (Debian's linux-perf) and root or
# kernel.perf_event_paranoid <= -1. Usage: scripts/profile/exchange.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
n=${1:-1}
out=$(mktemp -d)
bin=target/release/distbelief
[ -x "$bin" ] || cargo build --release -p distbelief
sed -e "s/name: fashion-mnist-downpour/name: profile-$n/" \
    -e "s/nFetch: 2/nFetch: $n/" -e "s/nPush: 2/nPush: $n/" \
    -e "s/targetTestAccuracy: 0.85/targetTestAccuracy: 0.99/" \
    -e "s/maxSeconds: 600/maxSeconds: 30/" -e "s/evalIntervalSeconds: 0.25/evalIntervalSeconds: 10/" \
    examples/fashion-mnist-downpour.yaml > "$out/job.yaml"
"$bin" train "$out/job.yaml" --out "$out/run" --summary-json "$out/summary.json" > "$out/train.log" 2>&1 &
train=$!
sleep 10
perf record -a --call-graph dwarf,16384 -e cpu-clock -F 499 -o "$out/perf.data" -- sleep 4 2>/dev/null
wait "$train"
perf script -i "$out/perf.data" -F comm,pid,ip,sym 2>/dev/null > "$out/perf.txt"
python3 scripts/profile/classify.py "$out/perf.txt" "$out/run/processes.tsv" 4 "$out/summary.json" "$n"
echo "(raw data in $out)"
