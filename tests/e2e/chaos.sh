# Sourced by run.sh: chaos on Kubernetes (kit only).
# shellcheck shell=bash
#
# An audited job with replicated shards (2 shards x 2 members) and 3
# replicas trains for CHAOS_SECONDS. Every 10 s a random pod of the job
# (replica, shard member or coordinator) is deleted or frozen (SIGSTOP, until
# its liveness probe has it restarted). A shard member is faulted only while
# every shard pod is ready and 30 s after the last shard fault: a chain whose
# other member is still catching up has no copy to lose the pushes to, which
# is the promise's stated condition (docs/reliability.md). Halfway, the chart
# is upgraded to another image tag and the job scaled 3 -> 1 -> 3. The job must
# end Succeeded with 0 acknowledged pushes lost and 0 applied twice, and
# status.progress must never go back. E2E_CHAOS_SECONDS sets the length (CI:
# 75; the documented longer run: 240).
CHAOS=fashion-mnist-chaos
CHAOS_SECONDS=${E2E_CHAOS_SECONDS:-75}
chaos() {
  local name=$CHAOS end next kind pod pid last_shard=-100 upgraded="" scaled=""
  local deletes=0 freezes=0 on_replicas=0 on_shards=0 on_coordinator=0
  python3 - "$EXAMPLE" "$work/chaos.yaml" "$name" "$CHAOS_SECONDS" <<'PY' || { echo "could not derive $name"; return 1; }
import sys
src, dst, name, seconds = sys.argv[1:]
s = open(src).read()
for old, new in [
    ("  name: fashion-mnist-downpour\n", f"  name: {name}\n"),
    ("    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n",
     "    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n    trainLimit: 12000\n    testLimit: 2000\n"),
    # One node may hold both members of a shard (the kit has one).
    ("  parameterServers:\n    shards: 2\n    maxRestarts: 3\n", "  parameterServers:\n    shards: 2\n    replication: 2\n    maxRestarts: 1000\n    spread: {whenUnsatisfiable: ScheduleAnyway}\n"),
    ("    targetTestAccuracy: 0.85\n", "    targetTestAccuracy: 0.999\n"),
    ("    maxSeconds: 600\n", f"    maxSeconds: {seconds}\n"),
    ("    maxEpochs: 20\n", "    maxEpochs: 1000\n"),
    ("  replicas:\n    count: 2\n    maxRestarts: 3\n", "  replicas:\n    count: 3\n    maxRestarts: 1000\n"),
]:
    if old not in s:
        sys.exit(f"no {old!r}")
    s = s.replace(old, new, 1)
open(dst, "w").write(s)
PY
  output_claim || { echo "no default StorageClass: the audit needs the output claim"; return 1; }
  printf '  output:\n    volumeClaimName: %s\n    audit: true\n' "$OUTPUT_CLAIM" >>"$work/chaos.yaml"
  "${KUBECTL[@]}" apply -n "$JOB_NS" -f "$work/chaos.yaml" >/dev/null || return 1
  log "applied $JOB_NS/$name (2 shards x 2 members, 3 replicas, audited, maxSeconds $CHAOS_SECONDS)"
  job_wait "$name" "$STEP_TIMEOUT" "phase Running with step > 0" t_training || return 1
  progress_watch "$name" "$work/chaos-progress.tsv" &
  local watcher=$!
  end=$((SECONDS + CHAOS_SECONDS - 10))
  next=$SECONDS
  while [ "$SECONDS" -lt "$end" ]; do
    snap "$name"
    case "$J_PHASE" in Succeeded | Failed) break ;; esac
    if [ -z "$upgraded" ] && [ "$SECONDS" -ge $((end - CHAOS_SECONDS / 2)) ]; then
      upgraded=1
      ctr --address "$(dirname "$KUBECONFIG")/containerd/containerd.sock" -n k8s.io images tag --force \
        "$IMAGE_REPO:$IMAGE_TAG" "$IMAGE_REPO:$IMAGE_TAG-upgraded" >/dev/null || { kill "$watcher"; return 1; }
      chart_to "$IMAGE_TAG-upgraded" || { kill "$watcher"; return 1; }
      "${KUBECTL[@]}" scale dbj -n "$JOB_NS" "$name" --replicas=1 >/dev/null || { kill "$watcher"; return 1; }
      log "$name: chart upgraded to $IMAGE_TAG-upgraded; kubectl scale --replicas=1"
      scaled=$SECONDS
    fi
    if [ -n "$scaled" ] && [ $((SECONDS - scaled)) -ge 10 ]; then
      "${KUBECTL[@]}" scale dbj -n "$JOB_NS" "$name" --replicas=3 >/dev/null || { kill "$watcher"; return 1; }
      log "$name: kubectl scale --replicas=3"
      scaled=""
    fi
    if [ "$SECONDS" -ge "$next" ]; then
      next=$((SECONDS + 10))
      pod=$(chaos_pick "$name" "$last_shard") || { sleep 1; continue; }
      case "$pod" in *-ps-*) last_shard=$SECONDS on_shards=$((on_shards + 1)) ;;
        *-coordinator) on_coordinator=$((on_coordinator + 1)) ;;
        *) on_replicas=$((on_replicas + 1)) ;; esac
      if [ $((RANDOM % 2)) -eq 0 ] && pid=$(pod_pid "$pod" 2>/dev/null); then
        kill -STOP "$pid" 2>/dev/null && freezes=$((freezes + 1)) && kind=froze
      else
        "${KUBECTL[@]}" delete pod -n "$JOB_NS" "$pod" --wait=false >/dev/null 2>&1 && deletes=$((deletes + 1)) && kind=deleted
      fi
      log "$name: chaos: $kind $pod"
    fi
    sleep 1
  done
  [ -z "$scaled" ] || "${KUBECTL[@]}" scale dbj -n "$JOB_NS" "$name" --replicas=3 >/dev/null
  [ -z "$upgraded" ] || chart_to "$IMAGE_TAG" || { kill "$watcher"; return 1; }
  job_wait "$name" "$JOB_TIMEOUT" "a final phase" t_finished || { kill "$watcher"; return 1; }
  kill "$watcher" 2>/dev/null
  wait "$watcher" 2>/dev/null
  log "$name: faults: $deletes deletions, $freezes freezes ($on_replicas on replicas, $on_shards on shard members, $on_coordinator on the coordinator); final phase $J_PHASE, testAccuracy $J_ACC"
  [ "$J_PHASE" = Succeeded ] || { echo "$name: phase $J_PHASE, expected Succeeded"; return 1; }
  [ $((deletes + freezes)) -ge 3 ] || { echo "$name: only $((deletes + freezes)) faults"; return 1; }
  progress_never_went_back "$name" "$work/chaos-progress.tsv" "" || return 1
  audit_clean "$name" "$work/chaos.yaml" || return 1
  "${KUBECTL[@]}" delete dbj -n "$JOB_NS" "$name" --wait=false >/dev/null || return 1
}

# chaos_pick NAME LAST_SHARD_FAULT: a random running pod of the job; shard
# pods only when all four are ready and the last shard fault is 30 s old.
chaos_pick() {
  local name=$1 last=$2 candidates ready
  candidates=$("${KUBECTL[@]}" get pods -n "$JOB_NS" -l "distbelief.dev/job=$name" \
    --field-selector=status.phase=Running -o 'jsonpath={range .items[*]}{.metadata.name}{"\n"}{end}' 2>/dev/null)
  ready=$("${KUBECTL[@]}" get pods -n "$JOB_NS" -l "distbelief.dev/job=$name,distbelief.dev/role=ps" \
    -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null | grep -c True)
  if [ "$ready" -ne 4 ] || [ $((SECONDS - last)) -lt 30 ]; then
    candidates=$(grep -v -- '-ps-' <<<"$candidates")
  fi
  [ -n "$candidates" ] || return 1
  shuf -n 1 <<<"$candidates"
}
