#!/usr/bin/env bash
# Long runs of the fuzz targets with libFuzzer (cargo-fuzz), one target at a
# time on one core, each for RUNS executions (default 1,000,000):
#   scripts/fuzz.sh                  # every target
#   scripts/fuzz.sh push 5000000     # one target, 5 M executions
# Installs cargo-fuzz when it is missing. Stable Rust takes cargo-fuzz's
# nightly flags with RUSTC_BOOTSTRAP=1. Each run starts from a scratch copy
# of the committed seeds (fuzz/corpus/<target>), so what libFuzzer adds never
# lands in the repository; crashes are written to fuzz/artifacts/<target>/.
# The last line per target: its executions, exec/s and result. The script
# fails when any target found a crash, a hang or an out-of-memory.
set -euo pipefail
cd "$(dirname "$0")/.."

target=${1:-all}
runs=${2:-1000000}
# libFuzzer's limits: one input may run 10 s and the process may use 2 GiB,
# and no single allocation may pass 1 GiB, as no header from outside should
# make one that large.
flags=(-runs="$runs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=4096 -print_final_stats=1)

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi
# The same dependency versions as the workspace.
[ -f fuzz/Cargo.lock ] || cp Cargo.lock fuzz/Cargo.lock

all=$(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^distbelief-fuzz$')
if [ "$target" = all ]; then
  targets=$all
else
  grep -qx "$target" <<<"$all" || { echo "no fuzz target $target; there are: $(echo $all)" >&2; exit 2; }
  targets=$target
fi

cd fuzz
export RUSTC_BOOTSTRAP=1
echo "== cargo fuzz build -O" >&2
nice -n 10 cargo fuzz build -O
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
summary=()
for t in $targets; do
  mkdir -p "$scratch/$t" "artifacts/$t"
  cp corpus/"$t"/* "$scratch/$t/"
  log="$scratch/$t.log"
  echo "== $t: nice -n 10 cargo fuzz run -O $t $scratch/$t -- ${flags[*]}" >&2
  if nice -n 10 cargo fuzz run -O "$t" "$scratch/$t" -- "${flags[@]}" >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see fuzz/artifacts/$t/)"
    status=1
    tail -40 "$log" >&2
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  line="$t: ${execs:-?} executions, ${speed:-?} exec/s, $result"
  echo "$line" >&2
  summary+=("$line")
done
echo "== summary" >&2
printf '%s\n' "${summary[@]}"
exit $status
