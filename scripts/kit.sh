#!/usr/bin/env bash
# The single-node Kubernetes kit (a real control plane and node, no Docker;
# see its README.md) as the project uses it: for tests/e2e/run.sh and by hand.
#
#   scripts/kit.sh path   print the kit's directory, or exit 1 saying it is absent
#   scripts/kit.sh up     start the control plane and the node, or reuse them if
#                         they run; stdout is only the two lines
#                           export KUBECONFIG=...
#                           export PATH=...:$PATH
#                         so that   eval "$(scripts/kit.sh up)"   points kubectl
#                         at it. The kit's own progress is kept back and shown
#                         on stderr only if something fails.
#   scripts/kit.sh down   stop the node and the control plane (state and volumes
#                         are kept)
#
# The kit is looked for at ${DISTBELIEF_K8S_KIT:-<repo>/../shared/k8s}, then at
# /work/shared/k8s. Its state lives in ${K8S_STATE:-$HOME/.cache/distbelief-k8s}.
# There is one kit per machine: up and down take a lock, so two callers never
# start or stop it at the same time, and both are bounded in time. The kit
# needs root.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${K8S_STATE:-$HOME/.cache/distbelief-k8s}
LOCK_TIMEOUT=${KIT_LOCK_TIMEOUT:-900}   # seconds to wait for another up/down
UP_TIMEOUT=${KIT_UP_TIMEOUT:-600}       # up.sh (the first use on a machine runs apt-get)
NODE_TIMEOUT=${KIT_NODE_TIMEOUT:-600}   # node-up.sh (likewise)
DOWN_TIMEOUT=${KIT_DOWN_TIMEOUT:-180}

die() { printf 'kit.sh: %s\n' "$*" >&2; exit 1; }

candidates=("${DISTBELIEF_K8S_KIT:-$ROOT/../shared/k8s}" /work/shared/k8s)

kit_dir() {
  local d
  for d in "${candidates[@]}"; do
    if [ -f "$d/up.sh" ] && [ -f "$d/node-up.sh" ] && [ -f "$d/mkimage.py" ]; then
      (cd "$d" && pwd)
      return 0
    fi
  done
  return 1
}

need_kit() {
  KIT=$(kit_dir) || die "no Kubernetes kit (looked for up.sh, node-up.sh and mkimage.py in: ${candidates[*]}; set DISTBELIEF_K8S_KIT to its directory)"
}

# with_lock CMD...: runs CMD holding the machine-wide kit lock.
with_lock() {
  mkdir -p "$(dirname "$STATE")"
  local lock="$STATE.lock"
  exec 9>>"$lock"
  flock -w "$LOCK_TIMEOUT" 9 || die "another kit.sh up/down still holds $lock after ${LOCK_TIMEOUT}s"
  "$@"
}

# quiet SECONDS OUTFILE SCRIPT: runs a kit script bounded in time, its stdout
# into OUTFILE and its stderr kept back; on failure both go to stderr.
quiet() {
  local secs=$1 out=$2 script=$3 err rc=0
  err=$(mktemp)
  # 9>&-: the daemons the kit starts must not inherit (and so hold) the lock.
  timeout --kill-after=20 "$secs" "$KIT/$script" >"$out" 2>"$err" 9>&- || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$out" "$err" >&2
    rm -f "$err"
    [ "$rc" -eq 124 ] && die "$KIT/$script did not finish within ${secs}s (logs: $STATE/logs/)"
    die "$KIT/$script failed (exit $rc; logs: $STATE/logs/)"
  fi
  rm -f "$err"
}

up() {
  [ "$(id -u)" -eq 0 ] || die "the kit needs root"
  local out kubeconfig bin
  out=$(mktemp)
  quiet "$UP_TIMEOUT" "$out" up.sh
  # up.sh prints "export KUBECONFIG=<file>" and "export PATH=<bin>:$PATH   # kubectl".
  kubeconfig=$(sed -n 's/^export KUBECONFIG=\([^ ]*\).*/\1/p' "$out" | tail -n 1)
  bin=$(sed -n 's/^export PATH=\([^:]*\):.*/\1/p' "$out" | tail -n 1)
  rm -f "$out"
  if [ -z "$kubeconfig" ] || [ -z "$bin" ]; then
    die "up.sh did not print its KUBECONFIG and PATH exports"
  fi
  out=$(mktemp)
  quiet "$NODE_TIMEOUT" "$out" node-up.sh
  rm -f "$out"
  [ -x "$bin/kubectl" ] || die "no kubectl in $bin"
  # node-up.sh waits for the node to be Ready; one bounded look confirms the
  # API server answers with these credentials.
  KUBECONFIG=$kubeconfig timeout 30 "$bin/kubectl" --request-timeout=20s get --raw /readyz >/dev/null 2>&1 ||
    die "the kit started but its API server does not answer (KUBECONFIG=$kubeconfig)"
  printf 'export KUBECONFIG=%q\n' "$kubeconfig"
  # shellcheck disable=SC2016  # $PATH is for the caller's eval to expand
  printf 'export PATH=%q:"$PATH"\n' "$bin"
}

down() {
  [ "$(id -u)" -eq 0 ] || die "the kit needs root"
  timeout --kill-after=20 "$DOWN_TIMEOUT" "$KIT/down.sh" 9>&- || die "$KIT/down.sh failed or took more than ${DOWN_TIMEOUT}s"
}

case "${1:-}" in
  path) need_kit; echo "$KIT" ;;
  up) need_kit; with_lock up ;;
  down) need_kit; with_lock down ;;
  *) die "usage: scripts/kit.sh up|path|down" ;;
esac
