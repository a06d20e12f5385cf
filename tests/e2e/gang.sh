# Sourced by run.sh: two jobs that do not both fit on the node, applied
# together, once as gangs (spec.scheduling.gang, Kubernetes' own PodGroups)
# and once pod by pod.
# shellcheck shell=bash
#
# A job is blocked once it has had bound pods beside one the scheduler
# cannot place for 10 s; the CPU its bound pods ask for is counted from then.
#
# Each job is 1 shard, the coordinator and 1 replica, every pod asking for
# about a quarter of the CPU the node has free, so that one job fits and two
# do not, while the four server pods of both do (pod by pod, the shards and
# the coordinator start first, replicas once every shard serves). As gangs,
# one job runs to Succeeded while none of the other's pods is bound, then
# the other runs: no CPU is ever held by a job that cannot start. Pod by pod,
# the same pair holds CPU in pods of a job whose other pods cannot be
# scheduled (both jobs' servers bound, neither replica placed: a deadlock
# that only their start deadline ends, or one job's servers bound while the
# other trains); the step measures how long and how much.
GANG=gang-pair
gang_free_cpu() { # millicores the node has that no pod requests
  "${KUBECTL[@]}" get nodes,pods -A -o json | python3 -c '
import json, sys
items = json.load(sys.stdin)["items"]
def milli(q):
    q = str(q)
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)
nodes = [i for i in items if i["kind"] == "Node"]
alloc = sum(milli(n["status"]["allocatable"]["cpu"]) for n in nodes)
used = 0
for p in items:
    if p["kind"] != "Pod" or not p["spec"].get("nodeName"):
        continue
    if p["status"].get("phase") in ("Succeeded", "Failed"):
        continue
    for c in p["spec"]["containers"]:
        used += milli(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
print(alloc - used)'
}

gang_jobs() { # gang_jobs GANG(true|false) CPU(m) DEADLINE OUT: jobs a and b
  python3 - "$EXAMPLE" "$4" "$GANG" "$1" "$2" "$3" <<'PY'
import sys
src, dst, prefix, gang, cpu, deadline = sys.argv[1:]
base = open(src).read()
docs = []
for who in ("a", "b"):
    s = base
    for old, new in [
        ("  name: fashion-mnist-downpour\n", f"  name: {prefix}-{gang[0]}{who}\n"),
        ("    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n",
         "    testLabels: /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz\n    trainLimit: 6000\n    testLimit: 1000\n"),
        ("  parameterServers:\n    shards: 2\n",
         f"  parameterServers:\n    shards: 1\n    resources: {{requests: {{cpu: {cpu}m}}}}\n"),
        ("  replicas:\n    count: 2\n",
         f"  replicas:\n    count: 1\n    resources: {{requests: {{cpu: {cpu}m}}}}\n"),
        ("    targetTestAccuracy: 0.85\n", "    targetTestAccuracy: 0.999\n"),
        ("    maxSeconds: 600\n", "    maxSeconds: 15\n"),
    ]:
        if old not in s:
            sys.exit(f"no {old!r}")
        s = s.replace(old, new, 1)
    s = s.rstrip("\n") + f"\n  coordinator:\n    resources: {{requests: {{cpu: {cpu}m}}}}\n  scheduling:\n    gang: {gang}\n"
    if deadline != "0":
        s += f"  startDeadlineSeconds: {deadline}\n"
    docs.append(s)
open(dst, "w").write("---\n".join(docs))
PY
}

# gang_watch GANG(true|false) CPU LIMIT: polls both jobs every second until
# both have a final phase or LIMIT seconds pass; prints one JSON line. In
# gang mode it fails as soon as a pod of the second job is bound while the
# first has not finished.
gang_watch() {
  python3 - "$JOB_NS" "$GANG-${1:0:1}" "$1" "$2" "$3" <<'PY'
import json, subprocess, sys, time
ns, prefix, gang, cpu, limit = sys.argv[1:]
cpu, limit, gang = int(cpu) / 1000, float(limit), gang == "true"
names = [prefix + "a", prefix + "b"]
def get(*args):
    out = subprocess.run(["kubectl", "--request-timeout=30s", "get", "-n", ns, *args, "-o", "json"],
                         capture_output=True, text=True)
    return json.loads(out.stdout)["items"] if out.returncode == 0 else None
def unschedulable(p):
    return any(c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
               for c in p.get("status", {}).get("conditions", []))
start = time.time()
last = start
held = 0.0          # CPU-seconds in bound pods of jobs with a pod the scheduler cannot place
blocked_both = 0.0  # seconds during which both jobs held bound pods and neither could start
first = None
phases = {}
blocked_since = {n: None for n in names}
while True:
    jobs, pods = get("dbj", *names), get("pods", "-l", "distbelief.dev/job in (%s)" % ",".join(names))
    now = time.time()
    dt, last = now - last, now
    if jobs is None or pods is None:
        time.sleep(1)
        continue
    phases = {j["metadata"]["name"]: j.get("status", {}).get("phase", "") for j in jobs}
    bound = {n: 0 for n in names}
    stuck = {n: 0 for n in names}
    for p in pods:
        if p["metadata"].get("deletionTimestamp"):
            continue
        n = p["metadata"]["labels"]["distbelief.dev/job"]
        if p["spec"].get("nodeName") and p["status"].get("phase") in ("Pending", "Running"):
            bound[n] += 1
        elif unschedulable(p):
            stuck[n] += 1
    # Blocked: bound pods beside one the scheduler cannot place, for 10 s
    # and more (a gang's pods are bound one call at a time, so a poll can
    # catch one half bound, for as long as a loaded API server takes).
    for n in names:
        if bound[n] and stuck[n]:
            blocked_since[n] = blocked_since[n] or now
        else:
            blocked_since[n] = None
    blocked = {n: blocked_since[n] is not None and now - blocked_since[n] >= 10 for n in names}
    for n in names:
        if blocked[n]:
            held += bound[n] * cpu * dt
    if all(blocked.values()):
        blocked_both += dt
    if gang:
        if first is None:
            on = [n for n in names if bound[n]]
            if len(on) == 2:
                sys.exit(f"both gangs have bound pods at once: {bound}")
            first = on[0] if on else None
        elif phases.get(first) not in ("Succeeded", "Failed"):
            other = names[1 - names.index(first)]
            if bound[other]:
                sys.exit(f"{other} has {bound[other]} pods bound while {first} is still {phases.get(first)}")
    done = all(phases.get(n) in ("Succeeded", "Failed") for n in names)
    if done or now - start > limit:
        break
    time.sleep(1)
print(json.dumps({"gang": gang, "cpu_per_pod": cpu, "seconds": round(time.time() - start, 1),
                  "phases": phases, "first": first, "cpu_seconds_held_by_blocked_jobs": round(held, 1),
                  "seconds_both_blocked": round(blocked_both, 1)}))
PY
}

gang_pair() {
  local free cpu out held
  # The earlier steps' pods must be gone: CPU they free mid-step would let
  # the pair fit.
  until_empty "$STEP_TIMEOUT" "${KUBECTL[@]}" get pods -n "$JOB_NS" -l distbelief.dev/job -o name || return 1
  free=$(gang_free_cpu) || { echo "cannot read the node's free CPU"; return 1; }
  # One job (3 pods) fits, two do not; the 4 server pods of both do, a
  # fifth pod does not.
  cpu=$((free * 24 / 100))
  log "$GANG: the node has ${free}m CPU unrequested; every pod asks for ${cpu}m"
  [ "$cpu" -ge 100 ] || { echo "too little free CPU on the node (${free}m) for the pair"; return 1; }

  gang_jobs true "$cpu" 0 "$work/gang.yaml" || { echo "could not derive the gang jobs"; return 1; }
  "${KUBECTL[@]}" apply -n "$JOB_NS" -f "$work/gang.yaml" >/dev/null || return 1
  log "$GANG: applied $GANG-ta and $GANG-tb as gangs"
  out=$(gang_watch true "$cpu" 240) || { echo "$out"; return 1; }
  log "$GANG (gangs): $out"
  for n in ta tb; do
    [ "$(jp "dbj/$GANG-$n" '{.status.phase}')" = Succeeded ] || { echo "$GANG-$n did not succeed: $out"; return 1; }
    [ "$(jp "dbj/$GANG-$n" '{.status.conditions[?(@.type=="GangScheduling")].status}')" = True ] ||
      { echo "$GANG-$n: GangScheduling is not True"; return 1; }
  done
  held=$(printf '%s' "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["cpu_seconds_held_by_blocked_jobs"])')
  [ "$held" = 0.0 ] || { echo "gangs held ${held} CPU-seconds in jobs that could not start"; return 1; }
  "${KUBECTL[@]}" delete dbj -n "$JOB_NS" "$GANG-ta" "$GANG-tb" --wait=true --timeout=120s >/dev/null || return 1

  gang_jobs false "$cpu" 40 "$work/podbypod.yaml" || { echo "could not derive the pod-by-pod jobs"; return 1; }
  "${KUBECTL[@]}" apply -n "$JOB_NS" -f "$work/podbypod.yaml" >/dev/null || return 1
  log "$GANG: applied $GANG-fa and $GANG-fb pod by pod (startDeadlineSeconds 40)"
  out=$(gang_watch false "$cpu" 180) || { echo "$out"; return 1; }
  log "$GANG (pod by pod): $out"
  held=$(printf '%s' "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["cpu_seconds_held_by_blocked_jobs"])')
  ge "$held" 1 || { echo "pod by pod, no CPU was held by a job that could not start (${held} CPU-seconds): the pair fitted after all"; return 1; }
  "${KUBECTL[@]}" delete dbj -n "$JOB_NS" "$GANG-fa" "$GANG-fb" --wait=false >/dev/null || return 1
}
