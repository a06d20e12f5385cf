#!/usr/bin/env bash
# The whole test suite. Everything builds in release mode, once: the tests
# train real models, and clippy shares the release build's proc-macros.
#
# After fmt and clippy (which stop the run at once when they fail) come three
# suites that all run even if an earlier one failed: the manifest checks, the
# cargo tests (with the control-plane tests against the Kubernetes kit) and
# the end-to-end suite on kind or the kit's node (each skips, counted as
# skipped, where it cannot run), with the link check of the docs beside the
# manifests. The last line adds them all up:
#   tests: N passed, N failed, N skipped
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's wall time, printed at the end, so that a slow suite shows
# (docs/development.md lists what each takes on 2 cores).
run_start=$SECONDS
step_name=
step_start=$SECONDS
times=()
step() {
  [ -n "$step_name" ] && times+=("$(printf '%-28s %5d s' "$step_name" $((SECONDS - step_start)))")
  step_name=$1
  step_start=$SECONDS
  [ -n "$step_name" ] && echo "== $step_name" >&2
  return 0
}

step "setup (scripts/setup.sh)"
scripts/setup.sh --test
step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy (builds)"
cargo clippy --release --locked --workspace --all-targets -- -D warnings

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0

step "manifests and links"
scripts/check-manifests.sh 2>&1 | tee -a "$log" || status=1
python3 scripts/check-links.py 2>&1 | tee -a "$log" || status=1

# The control-plane tests (cli/tests/controlplane.rs, named kit_*) run
# against the Kubernetes kit's real API server when ../shared/k8s is there;
# the kit is started once here (or reused) and shared with tests/e2e/run.sh.
# The object store tests read data through an S3-compatible server on
# 127.0.0.1, started here and stopped when the run ends.
step "S3-compatible server (scripts/s3.sh up)"
if s3_env=$(scripts/s3.sh up); then
  eval "$s3_env"
  trap 'rm -f "$log"; scripts/s3.sh down' EXIT
else
  echo "FAIL: the S3-compatible server did not start" | tee -a "$log"
  status=1
fi

kit_args=()
if scripts/kit.sh path >/dev/null 2>&1; then
  # One test run at a time per kit: the e2e suite installs a cluster-wide
  # operator with Helm, which would also reconcile another run's
  # control-plane jobs. A second run waits here, bounded, until the first
  # is done.
  state=${K8S_STATE:-$HOME/.cache/distbelief-k8s}
  mkdir -p "$state"
  exec 8>"$state/test-run.lock"
  if ! flock -n 8; then
    echo "== waiting (up to 60 min) for another test run that uses the kit" >&2
    flock -w 3600 8 || { echo "FAIL: another test run held the kit for 60 min" | tee -a "$log"; status=1; }
  fi
  step "Kubernetes kit (scripts/kit.sh up)"
  # 8>&-: the kit's daemons outlive this run and must not hold the lock.
  if kit_env=$(scripts/kit.sh up 8>&-); then
    eval "$kit_env"
    export DISTBELIEF_KIT_KUBECONFIG="$KUBECONFIG"
  else
    echo "FAIL: the Kubernetes kit is present but did not start" | tee -a "$log"
    status=1
  fi
fi
if [ -z "${DISTBELIEF_KIT_KUBECONFIG:-}" ]; then
  kit_args=(-- --skip kit_)
fi

step "cargo test: build"
# --all-targets: unit, integration and binary tests (the crates have no doctests).
# The control-plane tests mostly wait on the API server, so their binary
# runs beside the rest (from the package's directory, as cargo runs it),
# which takes about 7 minutes off the run; its output joins the log after.
kit_out=
if [ -n "${DISTBELIEF_KIT_KUBECONFIG:-}" ]; then
  # Everything is built first, so that no compile shares the cores with them.
  kit_bin=$(cargo test --release --locked --workspace --all-targets --no-run --message-format=json 8>&- |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("target", {}).get("name") == "controlplane" and m.get("executable"):
        print(m["executable"])' || true)
  if [ -n "$kit_bin" ]; then
    kit_out=$(mktemp)
    (cd cli && "$kit_bin" kit_) > "$kit_out" 2>&1 8>&- &
    kit_pid=$!
    kit_args=(-- --skip kit_)
  fi
fi
step "cargo test (and kit_ beside)"
cargo test --release --locked --workspace --all-targets --no-fail-fast "${kit_args[@]}" 8>&- 2>&1 | tee -a "$log" || status=1
if [ -n "$kit_out" ]; then
  step "control-plane tests: rest"
  wait "$kit_pid" || status=1
  tee -a "$log" < "$kit_out"
  rm -f "$kit_out"
elif [ ${#kit_args[@]} -gt 0 ]; then
  # Counted as skipped, never as passed: say which and why.
  n=$(cargo test --release --locked -p distbelief --test controlplane -- --list 2>/dev/null | grep -c 'kit_.*: test$' || true)
  echo "SKIP: $n control-plane tests: no Kubernetes kit (scripts/kit.sh path: $(scripts/kit.sh path 2>&1 | tail -n 1))"
  echo "controlplane: 0 passed, 0 failed, $n skipped" | tee -a "$log"
fi

step "e2e (tests/e2e/run.sh)"
tests/e2e/run.sh 8>&- 2>&1 | tee -a "$log" || status=1
step ""
echo "== time by step" >&2
printf '%s\n' "${times[@]}" >&2
printf '%-28s %5d s\n' "total" $((SECONDS - run_start)) >&2

# cargo prints one "test result:" line per test binary; the two scripts print
# one "<name>: N passed, N failed, N skipped" line each.
awk '/^test result:/ { p += $4; f += $6; s += $8 }
     /^(manifests|links|e2e|controlplane): [0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$/ { p += $2; f += $4; s += $6 }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log" || status=1
# A suite can fail without a failed count (a compile error, a crashed script).
exit "$status"
