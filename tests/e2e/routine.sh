# Sourced by run.sh: routine cluster operations on a running, audited job.
# shellcheck shell=bash
#
# A copy of the example with 3 replicas (training until maxSeconds; no
# slowed replica, which would pin the count) has
# replica 2's pod deleted (its replacement is attempt 1); then the chart is
# upgraded to another image tag (kit: the same image under a second tag) and
# the job scaled 3 -> 1 -> 3. No shard pod may be replaced and every pod of
# the job keeps the image it started with (status.image); each re-added
# replica starts past every attempt it had and trains; before the upgrade, an
# edit that a looser CRD admits and the operator refuses (refused_edit) leaves
# the job running; the chart goes back to
# the suite's tag; the shards' duplicate-push counter does not move across
# the rescale; the job ends Succeeded and its push logs show 0
# acknowledged pushes lost (a push taken for a duplicate of another process's
# counts as lost) and 0 applied twice.
ROUTINE=fashion-mnist-routine
routine_ops() {
  local name=$ROUTINE started shards_before shards_after images other sock steps1 steps2 dup_before dup_after
  python3 - "$EXAMPLE" "$work/routine.yaml" "$name" <<'PY' || { echo "could not derive $name"; return 1; }
import sys
src, dst, name = sys.argv[1:]
s = open(src).read()
for old, new in [
    ("  name: fashion-mnist-downpour\n", f"  name: {name}\n"),
    ("    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n",
     "    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n    trainLimit: 12000\n    testLimit: 2000\n"),
    ("    targetTestAccuracy: 0.85\n", "    targetTestAccuracy: 0.999\n"),
    ("    maxSeconds: 600\n", "    maxSeconds: 150\n"),
    ("    maxEpochs: 20\n", "    maxEpochs: 1000\n"),
    ("  replicas:\n    count: 2\n", "  replicas:\n    count: 3\n"),
]:
    if old not in s:
        sys.exit(f"no {old!r}")
    s = s.replace(old, new, 1)
open(dst, "w").write(s)
PY
  output_claim || { echo "no default StorageClass: the audit needs the output claim"; return 1; }
  printf '  output:\n    volumeClaimName: %s\n    audit: true\n' "$OUTPUT_CLAIM" >>"$work/routine.yaml"
  "${KUBECTL[@]}" apply -n "$JOB_NS" -f "$work/routine.yaml" >/dev/null || return 1
  log "applied $JOB_NS/$name (3 replicas, audited, maxSeconds 150)"
  # shellcheck disable=SC2317  # called through job_wait
  t_three_train() {
    [ "$(jp "dbj/$name" '{.status.replicasReady}')" = 3 ] &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==2)].steps}')" -gt 0 ] 2>/dev/null
  }
  job_wait "$name" "$STEP_TIMEOUT" "3 replicas training" t_three_train || return 1
  started=$(jp "dbj/$name" '{.status.image}')
  [ "$started" = "$IMAGE_REPO:$IMAGE_TAG" ] || { echo "status.image is '$started', expected $IMAGE_REPO:$IMAGE_TAG"; return 1; }
  shards_before=$(pod_uids "$name" distbelief.dev/role=ps)

  log "$name: deleting replica 2's pod $name-replica-2-0"
  "${KUBECTL[@]}" delete pod -n "$JOB_NS" "$name-replica-2-0" --wait=false >/dev/null || return 1
  # shellcheck disable=SC2317
  t_replaced() {
    [ -n "$(pods "$name" 'distbelief.dev/replica=2,distbelief.dev/attempt=1' --field-selector=status.phase=Running)" ] &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==2)].incarnation}')" = 2 ]
  }
  job_wait "$name" "$STEP_TIMEOUT" "replica 2 back as attempt 1 (incarnation 2)" t_replaced || return 1

  refused_edit "$name" || return 1

  if [ "$mode" = kit ]; then
    other=$IMAGE_TAG-upgraded
    sock="$(dirname "$KUBECONFIG")/containerd/containerd.sock"
    timeout 30 ctr --address "$sock" -n k8s.io images tag --force "$IMAGE_REPO:$IMAGE_TAG" "$IMAGE_REPO:$other" >/dev/null ||
      { echo "could not tag the image as $IMAGE_REPO:$other on the node"; return 1; }
    chart_to "$other" || return 1
  else
    log "$name: no second image tag outside the kit; the chart is upgraded with the same values"
    chart_to "$IMAGE_TAG" || return 1
  fi

  dup_before=$(shard_duplicates "$name") || { echo "$dup_before"; return 1; }
  "${KUBECTL[@]}" scale dbj -n "$JOB_NS" "$name" --replicas=1 >/dev/null || return 1
  log "$name: kubectl scale --replicas=1"
  # shellcheck disable=SC2317
  t_one_left() {
    [ -z "$(pods "$name" 'distbelief.dev/role=replica,distbelief.dev/replica in (1,2)')" ]
  }
  job_wait "$name" 90 "replicas 1 and 2 gone" t_one_left || return 1
  steps1=$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==1)].steps}')
  steps2=$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==2)].steps}')
  "${KUBECTL[@]}" scale dbj -n "$JOB_NS" "$name" --replicas=3 >/dev/null || return 1
  log "$name: kubectl scale --replicas=3 (replica 1 had ${steps1:-0} steps, replica 2 ${steps2:-0})"
  # Replica 1 had attempt 0 and replica 2 attempt 1: each starts past it,
  # with a new incarnation, and trains (a reused one would be told to stop).
  # shellcheck disable=SC2317
  t_back() {
    [ -n "$(pods "$name" 'distbelief.dev/replica=1,distbelief.dev/attempt=1' --field-selector=status.phase=Running)" ] &&
      [ -n "$(pods "$name" 'distbelief.dev/replica=2,distbelief.dev/attempt=2' --field-selector=status.phase=Running)" ] &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==1)].incarnation}')" = 2 ] &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==2)].incarnation}')" = 3 ] &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==1)].steps}')" -gt 0 ] 2>/dev/null &&
      [ "$(jp "dbj/$name" '{.status.progress.replicas[?(@.replica==2)].steps}')" -gt 0 ] 2>/dev/null
  }
  job_wait "$name" "$STEP_TIMEOUT" "replicas 1 and 2 back as new incarnations (2 and 3), both training" t_back || return 1

  dup_after=$(shard_duplicates "$name") || { echo "$dup_after"; return 1; }
  log "$name: the shards' distbelief_ps_duplicate_pushes_total: $dup_before before the rescale, $dup_after after"
  [ "$dup_after" = "$dup_before" ] || { echo "the shards took $((dup_after - dup_before)) pushes for duplicates across the rescale"; return 1; }
  shards_after=$(pod_uids "$name" distbelief.dev/role=ps)
  [ "$shards_after" = "$shards_before" ] || { printf 'shard pods were replaced:\nbefore %s\nafter  %s\n' "$shards_before" "$shards_after"; return 1; }
  images=$("${KUBECTL[@]}" get pods -n "$JOB_NS" -l "distbelief.dev/job=$name" \
    -o 'jsonpath={range .items[*]}{.spec.containers[0].image}{"\n"}{end}' | sort -u | tr '\n' ' ')
  [ "$images" = "$IMAGE_REPO:$IMAGE_TAG " ] || { echo "the job's pods run '$images', not only $IMAGE_REPO:$IMAGE_TAG"; return 1; }
  [ "$(jp "dbj/$name" '{.status.image}')" = "$started" ] || { echo "status.image moved"; return 1; }
  log "$name: after the upgrade and the rescale: the same $(wc -w <<<"$shards_before") shard pods, every pod on $images"
  [ "$mode" != kit ] || chart_to "$IMAGE_TAG" || return 1

  job_wait "$name" "$JOB_TIMEOUT" "a final phase" t_finished || return 1
  [ "$J_PHASE" = Succeeded ] || { echo "$name: phase $J_PHASE, expected Succeeded"; return 1; }
  [ "${J_RESTARTS:-0}" = 0 ] || { echo "$name: $J_RESTARTS replica restarts counted"; return 1; }
  log "$name: final testAccuracy $J_ACC"
  audit_clean "$name" "$work/routine.yaml" || return 1
  "${KUBECTL[@]}" delete dbj -n "$JOB_NS" "$name" --wait=false >/dev/null || return 1
}

# refused_edit NAME: a CRD that admits what the operator refuses, as during a
# rollout where the CRD and the operator come from different versions (here
# the live CRD without its rule on spec.stop.targetTestAccuracy). The edit
# is stored; the operator refuses it with SpecAccepted=False and one
# EditRefused event, and the job trains on: phase Running, the same pods,
# steps still growing. Undoing the edit turns SpecAccepted True; the CRD is
# then put back as it was, and refuses the edit again.
refused_edit() {
  local name=$1 crd=distbeliefjobs.distbelief.dev saved=$work/crd-saved.json uids_before uids_after steps end out
  "${KUBECTL[@]}" get crd "$crd" -o json >"$saved" || return 1
  python3 - "$saved" <<'PY' | "${KUBECTL[@]}" replace -f - >/dev/null || { echo "could not loosen the CRD"; return 1; }
import json, sys
c = json.load(open(sys.argv[1]))
spec = c["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
rules = spec["x-kubernetes-validations"]
kept = [r for r in rules if "targetTestAccuracy" not in r["rule"]]
if len(kept) != len(rules) - 1:
    sys.exit("expected one rule on spec.stop.targetTestAccuracy")
spec["x-kubernetes-validations"] = kept
json.dump(c, sys.stdout)
PY
  log "$name: the CRD without its rule on spec.stop.targetTestAccuracy"
  uids_before=$(pod_uids "$name" "")
  # The API server serves a changed CRD after a moment: retry the edit.
  end=$(until_time 60)
  until out=$("${KUBECTL[@]}" patch dbj -n "$JOB_NS" "$name" --type merge -p '{"spec":{"stop":{"targetTestAccuracy":1.5}}}' 2>&1); do
    [ "$SECONDS" -lt "$end" ] || { echo "the loosened CRD still refuses the edit: $out"; return 1; }
    sleep 2
  done
  log "$name: spec.stop.targetTestAccuracy edited to 1.5 (admitted)"
  # shellcheck disable=SC2317
  t_refused() {
    [ "$(jp "dbj/$name" '{.status.conditions[?(@.type=="SpecAccepted")].status}')" = False ]
  }
  job_wait "$name" 60 "SpecAccepted=False" t_refused || return 1
  log "$name: SpecAccepted: $(jp "dbj/$name" '{.status.conditions[?(@.type=="SpecAccepted")].message}')"
  [ "$(jp "dbj/$name" '{.status.phase}')" = Running ] || { echo "phase $(jp "dbj/$name" '{.status.phase}') after the refused edit"; return 1; }
  steps=$(jp "dbj/$name" '{.status.progress.step}')
  # shellcheck disable=SC2317
  t_trains_on() { [ "$(jp "dbj/$name" '{.status.progress.step}')" -gt "$steps" ] 2>/dev/null; }
  job_wait "$name" 60 "training past step $steps with the edit refused" t_trains_on || return 1
  out=$("${KUBECTL[@]}" get events -n "$JOB_NS" --field-selector "involvedObject.name=$name,reason=EditRefused" -o name 2>/dev/null | wc -l)
  [ "$out" = 1 ] || { echo "$out EditRefused events, expected 1"; return 1; }
  uids_after=$(pod_uids "$name" "")
  [ "$uids_after" = "$uids_before" ] || { printf 'pods changed under the refused edit:
before %s
after  %s
' "$uids_before" "$uids_after"; return 1; }
  "${KUBECTL[@]}" patch dbj -n "$JOB_NS" "$name" --type merge -p '{"spec":{"stop":{"targetTestAccuracy":0.999}}}' >/dev/null || return 1
  # shellcheck disable=SC2317
  t_accepted() {
    [ "$(jp "dbj/$name" '{.status.conditions[?(@.type=="SpecAccepted")].status}')" = True ]
  }
  job_wait "$name" 60 "SpecAccepted=True after the edit is undone" t_accepted || return 1
  python3 - "$saved" <<'PY' | "${KUBECTL[@]}" replace -f - >/dev/null || { echo "could not put the CRD back"; return 1; }
import json, sys
c = json.load(open(sys.argv[1]))
c["metadata"].pop("resourceVersion", None)
json.dump(c, sys.stdout)
PY
  end=$(until_time 60)
  while out=$("${KUBECTL[@]}" patch dbj -n "$JOB_NS" "$name" --dry-run=server --type merge -p '{"spec":{"stop":{"targetTestAccuracy":1.5}}}' 2>&1); do
    [ "$SECONDS" -lt "$end" ] || { echo "the restored CRD still admits the edit"; return 1; }
    sleep 2
  done
  case "$out" in *"must be in (0, 1]"*) ;; *) echo "the restored CRD refuses the edit for another reason: $out"; return 1 ;; esac
  log "$name: refused edit: the job trained on (same $(wc -w <<<"$uids_before") pods, 1 EditRefused event); the CRD is back and refuses it"
}

# pod_uids NAME [SELECTOR]: the uids of the job's pods matching it, sorted.
pod_uids() {
  "${KUBECTL[@]}" get pods -n "$JOB_NS" -l "distbelief.dev/job=$1${2:+,$2}" \
    -o 'jsonpath={range .items[*]}{.metadata.name}={.metadata.uid}{"\n"}{end}' | sort | tr '\n' ' '
}

# shard_duplicates NAME: the sum of distbelief_ps_duplicate_pushes_total
# over the job's shard pods, each read through kubectl port-forward.
shard_duplicates() {
  local p total=0 n port pf
  for p in $(pods "$1" distbelief.dev/role=ps); do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "${KUBECTL[@]}" port-forward -n "$JOB_NS" "$p" "$port:metrics" >/dev/null 2>&1 &
    pf=$!
    n=$(python3 - "$port" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/metrics"
deadline = time.time() + 20
while True:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        break
    except Exception as e:
        if time.time() > deadline:
            sys.exit(f"cannot fetch {url} through the port-forward: {e}")
        time.sleep(0.5)
values = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("distbelief_ps_duplicate_pushes_total")]
if not values:
    sys.exit("no distbelief_ps_duplicate_pushes_total")
print(int(sum(values)))
PY
    ) || { kill "$pf" 2>/dev/null; echo "$p: $n"; return 1; }
    kill "$pf" 2>/dev/null
    wait "$pf" 2>/dev/null
    total=$((total + n))
  done
  echo "$total"
}

# chart_to TAG: helm upgrade of the release to the image TAG, with every
# other value as installed; --wait waits for the operator to roll.
chart_to() {
  log "helm upgrade $RELEASE --reuse-values --set image.tag=$1"
  "$HELM" upgrade "$RELEASE" charts/distbelief -n "$RELEASE_NS" --reuse-values --force-conflicts \
    --set "image.tag=$1" --wait --timeout "${STEP_TIMEOUT}s" >/dev/null
}

# audit_clean NAME YAML: distbelief audit over the job's push logs on the
# output claim (read on this machine) must find acknowledged pushes, none
# lost and none applied twice; prints its figures.
audit_clean() {
  local name=$1 yaml=$2 host out
  host=$(output_host_dir) || { echo "$host"; return 1; }
  log "$name: push logs in $host/$name/audit: $(ls "$host/$name/audit" 2>/dev/null | tr '\n' ' ')"
  out=$(timeout 120 "$BINARY" audit "$yaml" --dir "$host/$name/audit" --json) || { echo "audit: $out"; return 1; }
  log "$name: audit: $out"
  printf '%s' "$out" | python3 -c '
import json, sys
v = json.load(sys.stdin)
if v["acknowledged"] < 1:
    sys.exit("no acknowledged push in the logs")
if v["lost"] or v["duplicated"]:
    sys.exit("%d acknowledged pushes lost, %d applied twice" % (v["lost"], v["duplicated"]))
' || return 1
}
