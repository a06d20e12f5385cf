#!/usr/bin/env bash
# Checks the Kubernetes packaging: the Helm chart lints and renders, the
# committed deploy/install.yaml is a fresh render, the rendered objects and
# the example jobs validate against the Kubernetes 1.33 schemas, and the
# chart's RBAC and switches do what values.yaml says.
#
# One line per check ("ok: ..." / "FAIL: ..." with the evidence indented
# below), then "manifests: N passed, N failed, N skipped". Exits 1 on any
# failure. The DistBeliefJob schema itself (the CRD) is checked against the
# examples by a Rust test; kubernetes-validate has no schema for our kinds.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

K8S_VERSION=1.33.0
CHART=charts/distbelief
HELM="$PWD/.tools/bin/helm"
KV="$PWD/.tools/venv/bin/kubernetes-validate"
PY="$PWD/.tools/venv/bin/python"   # has PyYAML, a kubernetes-validate dependency
ALL_ON=serviceMonitor.enabled=true,podMonitor.enabled=true,networkPolicy.enabled=true,grafanaDashboard.enabled=true

if [ ! -x "$HELM" ] || [ ! -x "$KV" ]; then
  scripts/setup.sh >&2 || { echo "FAIL: scripts/setup.sh could not install helm/kubernetes-validate"; echo "manifests: 0 passed, 1 failed, 0 skipped"; exit 1; }
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

passed=0 failed=0 skipped=0
# check DESCRIPTION COMMAND...: runs COMMAND; its output is shown only when it fails.
check() {
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "ok: $what"
    passed=$((passed + 1))
  else
    echo "FAIL: $what"
    printf '%s\n' "$out" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}

render() { "$HELM" template distbelief "$CHART" --namespace distbelief-system "$@"; }
render_to() { local out=$1; shift; render "$@" >"$out"; }

# kubernetes-validate only warns (and exits 0) on a kind it has no schema for,
# which would also let a misspelt apiVersion of a built-in kind through. So
# every such warning fails, except for the kinds we know are not built in.
known_crd_kinds="kind (DistBeliefJob with api version distbelief\.dev/v1alpha1|ServiceMonitor with api version monitoring\.coreos\.com/v1|PodMonitor with api version monitoring\.coreos\.com/v1) for"
validate() {
  local out unexpected
  out=$("$KV" --strict --quiet -k "$K8S_VERSION" "$@" 2>&1) || { printf '%s\n' "$out"; return 1; }
  unexpected=$(printf '%s\n' "$out" | grep -v -E "^WARN .*Couldn't find schema for $known_crd_kinds" | grep -v '^$')
  [ -z "$unexpected" ] || { printf '%s\n' "$unexpected"; return 1; }
}

# What kubernetes-validate cannot check in a DistBeliefJob file: the envelope
# (apiVersion, kind, a DNS-label name, a spec mapping). Other kinds in the
# file are left to validate() above.
job_envelope() {
  "$PY" - "$@" <<'PY'
import re, sys, yaml
errors, jobs = [], 0
for path in sys.argv[1:]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    if not docs:
        errors.append(f"{path}: no YAML documents")
    for i, doc in enumerate(docs, 1):
        where = f"{path} (document {i})"
        if not isinstance(doc, dict) or not doc.get("kind") or not doc.get("apiVersion"):
            errors.append(f"{where}: not a Kubernetes object (no kind/apiVersion)")
            continue
        if doc["kind"] != "DistBeliefJob":
            continue
        jobs += 1
        if doc["apiVersion"] != "distbelief.dev/v1alpha1":
            errors.append(f"{where}: apiVersion {doc['apiVersion']!r}, expected 'distbelief.dev/v1alpha1'")
        name = (doc.get("metadata") or {}).get("name", "")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", str(name)):
            errors.append(f"{where}: metadata.name {name!r} is not a DNS label")
        if not isinstance(doc.get("spec"), dict):
            errors.append(f"{where}: spec missing or not a mapping")
if jobs == 0:
    errors.append("no DistBeliefJob in " + " ".join(sys.argv[1:]))
print("\n".join(errors))
sys.exit(1 if errors else 0)
PY
}

# Asserts on a render: EXPECT is a comma-separated list of facts to check.
#   rbac=exact|exact+np   the ClusterRole holds exactly the verbs the operator
#                         uses (+ networkpolicies get, create, patch)
#   rbac=namespaced       watchNamespace=ml: a Role and RoleBinding in ml hold
#                         them, the ClusterRole only the StorageClass read
#   np=true|false         DISTBELIEF_NETWORK_POLICY and the operator's NetworkPolicy
#   metricsfrom=PAIRS     DISTBELIEF_METRICS_NAMESPACE_SELECTOR
#   crd=plain|keep|none   the CRD as in files/crd.yaml, with the keep annotation, or absent
#   jobimage=IMAGE        DISTBELIEF_IMAGE
assert_render() {
  "$PY" - "$@" <<'PY'
import sys, yaml
path, expect = sys.argv[1], dict(kv.split("=", 1) for kv in sys.argv[2].split(","))
docs = [d for d in yaml.safe_load_all(open(path)) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
errors = []

def one(kind):
    items = by_kind.get(kind, [])
    if len(items) != 1:
        errors.append(f"expected one {kind}, found {len(items)}")
        return {}
    return items[0]

RULES = {
    ("distbelief.dev", "distbeliefjobs"): {"get", "list", "watch", "delete"},
    ("distbelief.dev", "distbeliefjobs/status"): {"patch"},
    ("distbelief.dev", "distbeliefjobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "serviceaccounts"): {"get", "create", "patch"},
    # Each job's certificates: created once, never changed.
    ("", "secrets"): {"get", "create"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    # The StatefulSet controller's FailedCreate events, while shard pods are missing.
    ("", "events"): {"list"},
    # A gang-scheduled job's PodGroup.
    ("scheduling.k8s.io", "podgroups"): {"get", "create", "patch"},
}
CLUSTER_RULES = {("storage.k8s.io", "storageclasses"): {"list", "watch"}}

def verbs(obj):
    got = {}
    for rule in obj.get("rules", []):
        for g in rule.get("apiGroups", []):
            for r in rule.get("resources", []):
                got.setdefault((g, r), set()).update(rule.get("verbs", []))
    return got

def exactly(what, got, want):
    for key in sorted(set(want) | set(got)):
        if want.get(key) != got.get(key):
            errors.append(f"{what} {key[0] or 'core'}/{key[1]}: verbs {sorted(got.get(key, []))}, expected {sorted(want.get(key, []))}")

LEASE = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
if "rbac" in expect:
    # exact|exact+np: one ClusterRole with every rule; namespaced: a Role in
    # the watched namespace with the job rules, a ClusterRole with only the
    # cluster-scoped read.
    want = dict(RULES)
    if expect["rbac"] == "exact+np" or expect.get("np") == "true":
        want[("networking.k8s.io", "networkpolicies")] = {"get", "create", "patch"}
    roles = by_kind.get("Role", [])
    if expect["rbac"] == "namespaced":
        exactly("ClusterRole", verbs(one("ClusterRole")), CLUSTER_RULES)
        jobs = [r for r in roles if r["metadata"].get("namespace") == "ml"]
        if len(jobs) != 1:
            errors.append(f"expected one Role in the watched namespace ml, found {len(jobs)}")
        else:
            exactly("Role ml", verbs(jobs[0]), want)
        bindings = [b for b in by_kind.get("RoleBinding", []) if b["metadata"].get("namespace") == "ml"]
        if len(bindings) != 1 or bindings[0]["roleRef"]["kind"] != "Role":
            errors.append(f"expected one RoleBinding to the Role in ml: {bindings}")
        roles = [r for r in roles if r["metadata"].get("namespace") != "ml"]
    else:
        exactly("ClusterRole", verbs(one("ClusterRole")), {**want, **CLUSTER_RULES})
    lease = [r for role in roles for r in role.get("rules", [])]
    if lease != LEASE:
        errors.append(f"leader-election Role rules: {lease}")

deploy = one("Deployment")
containers = deploy.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])
env = {e["name"]: e.get("value") for e in containers[0].get("env", [])}
if "np" in expect:
    if env.get("DISTBELIEF_NETWORK_POLICY") != expect["np"]:
        errors.append(f"DISTBELIEF_NETWORK_POLICY={env.get('DISTBELIEF_NETWORK_POLICY')!r}, expected {expect['np']!r}")
    want_np = 1 if expect["np"] == "true" else 0
    if len(by_kind.get("NetworkPolicy", [])) != want_np:
        errors.append(f"{len(by_kind.get('NetworkPolicy', []))} NetworkPolicy objects, expected {want_np}")
if "metricsfrom" in expect and env.get("DISTBELIEF_METRICS_NAMESPACE_SELECTOR") != expect["metricsfrom"]:
    errors.append(f"DISTBELIEF_METRICS_NAMESPACE_SELECTOR={env.get('DISTBELIEF_METRICS_NAMESPACE_SELECTOR')!r}, expected {expect['metricsfrom']!r}")
if "jobimage" in expect and env.get("DISTBELIEF_IMAGE") != expect["jobimage"]:
    errors.append(f"DISTBELIEF_IMAGE={env.get('DISTBELIEF_IMAGE')!r}, expected {expect['jobimage']!r}")
if "crd" in expect:
    crds = by_kind.get("CustomResourceDefinition", [])
    if expect["crd"] == "none":
        if crds:
            errors.append("CRD rendered although crds.install=false")
    else:
        crd = one("CustomResourceDefinition")
        source = yaml.safe_load(open("charts/distbelief/files/crd.yaml"))
        annotations = dict(crd.get("metadata", {}).get("annotations") or {})
        keep = annotations.pop("helm.sh/resource-policy", None)
        if (keep == "keep") != (expect["crd"] == "keep"):
            errors.append(f"CRD helm.sh/resource-policy annotation is {keep!r}")
        if annotations:
            crd["metadata"]["annotations"] = annotations
        else:
            crd.get("metadata", {}).pop("annotations", None)
        if crd != source:
            errors.append("rendered CRD differs from charts/distbelief/files/crd.yaml")
print("\n".join(errors))
sys.exit(1 if errors else 0)
PY
}

# --- the chart ---------------------------------------------------------------
check "helm lint $CHART (default values)" "$HELM" lint --strict "$CHART"
check "helm lint $CHART ($ALL_ON)" "$HELM" lint --strict "$CHART" --set "$ALL_ON"
check "helm template (default values)" render_to "$tmp/default.yaml"
check "helm template ($ALL_ON)" render_to "$tmp/all-on.yaml" --set "$ALL_ON"
check "helm template (crds.keep=false, jobImage, watchNamespace, 3 replicas)" render_to "$tmp/variant.yaml" \
  --set crds.keep=false,jobImage=example.org/distbelief:9.9,watchNamespace=ml,replicaCount=3
check "helm template (crds.install=false, leader election off, network policy off)" render_to "$tmp/no-crd.yaml" \
  --set crds.install=false,leaderElection.enabled=false,networkPolicy.enabled=false
check "default render: exact RBAC with networkpolicies, network policy on, metrics from the monitoring namespace, CRD kept on uninstall, job image = operator image" \
  assert_render "$tmp/default.yaml" rbac=exact+np,np=true,metricsfrom=kubernetes.io/metadata.name=monitoring,crd=keep,jobimage=distbelief:0.1.0
check "all-options render: RBAC + networkpolicies patch, --network-policy on, operator NetworkPolicy" \
  assert_render "$tmp/all-on.yaml" rbac=exact+np,np=true,crd=keep
check "crds.keep=false/watchNamespace render: CRD without the keep annotation; jobImage passed on; namespaced RBAC" \
  assert_render "$tmp/variant.yaml" crd=plain,jobimage=example.org/distbelief:9.9,rbac=namespaced,np=true
check "crds.install=false/networkPolicy.enabled=false render: no CRD, no network policy" \
  assert_render "$tmp/no-crd.yaml" crd=none,np=false
# Two operators without a leader would both reconcile every job: the chart refuses.
refuses_leaderless() {
  if render --set replicaCount=2,leaderElection.enabled=false >/dev/null; then
    echo "rendered without error"
    return 1
  fi
}
check "helm template refuses replicaCount=2 without leader election" refuses_leaderless
# values.schema.json: a misspelt key or a wrong type is refused, naming it.
refuses_value() { # refuses_value WHAT-THE-ERROR-NAMES --set ...
  local names=$1 out
  shift
  if out=$(render "$@" 2>&1); then
    echo "rendered without error: $*"
    return 1
  fi
  grep -q -- "$names" <<<"$out" || { echo "the error does not name $names: $out"; return 1; }
}
check "values.schema.json refuses a misspelt key (imagee.tag)" refuses_value imagee --set imagee.tag=x
check "values.schema.json refuses a wrong type (replicaCount=many)" refuses_value replicaCount --set replicaCount=many
check "values.schema.json refuses an unknown pull policy" refuses_value pullPolicy --set image.pullPolicy=Sometimes

# The Grafana dashboard: off by default; on, one ConfigMap with the sidecar's
# label whose dashboard is the committed JSON, every panel with a query, and
# the PodMonitor putting the job label its panels select by on the series.
dashboard() {
  "$PY" - "$tmp/default.yaml" "$tmp/all-on.yaml" "$CHART/files/grafana-dashboard.json" <<'PY'
import json, sys, yaml
default, on, committed = sys.argv[1:]
def maps(path):
    return [d for d in yaml.safe_load_all(open(path)) if d and d["kind"] == "ConfigMap"
            and d["metadata"]["name"].endswith("-dashboard")]
errors = []
if maps(default):
    errors.append("the default render has a dashboard ConfigMap")
cms = maps(on)
if len(cms) != 1:
    errors.append(f"{len(cms)} dashboard ConfigMaps with grafanaDashboard.enabled=true")
else:
    cm = cms[0]
    if cm["metadata"]["labels"].get("grafana_dashboard") != "1":
        errors.append(f"labels {cm['metadata']['labels']} lack grafana_dashboard: \"1\"")
    dash = json.loads(cm["data"]["distbelief.json"])
    if dash != json.load(open(committed)):
        errors.append("the ConfigMap's dashboard is not files/grafana-dashboard.json")
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    empty = [p["title"] for p in panels if not all(t.get("expr") for t in p.get("targets", [])) or not p.get("targets")]
    if not panels or empty:
        errors.append(f"panels without a query: {empty}")
    # Two jobs of one name in two namespaces must never merge: every query
    # that picks a job also picks its namespace, and keeps it when summing.
    for p in panels:
        for t in p.get("targets", []):
            e = t.get("expr", "")
            if "$job" in e and ('namespace=~"$namespace"' not in e or
                                any(not g.startswith("namespace") for g in __import__("re").findall(r"by \(([^)]*)\)", e))):
                errors.append(f"{p['title']}: {e} does not keep the namespace")
pm = [d for d in yaml.safe_load_all(open(on)) if d and d["kind"] == "PodMonitor"]
if not pm or "distbelief.dev/job" not in pm[0]["spec"].get("podTargetLabels", []):
    errors.append("the PodMonitor does not put distbelief.dev/job on the series")
print("\n".join(errors))
sys.exit(1 if errors else 0)
PY
}
check "grafanaDashboard: off by default; on, a ConfigMap labelled for Grafana's sidecar with the dashboard, every panel queried" dashboard

# --- generated files -----------------------------------------------------------
check "$CHART/files/crd.yaml equals deploy/crd.yaml" diff -u deploy/crd.yaml "$CHART/files/crd.yaml"
install_is_fresh() {
  scripts/render-install.sh --stdout >"$tmp/install.yaml" || return 1
  diff -u deploy/install.yaml "$tmp/install.yaml" ||
    { echo "deploy/install.yaml is stale: run scripts/render-install.sh"; return 1; }
}
check "deploy/install.yaml equals a fresh render (scripts/render-install.sh)" install_is_fresh

# --- schemas -------------------------------------------------------------------
check "kubernetes-validate --strict (k8s $K8S_VERSION): deploy/install.yaml" validate deploy/install.yaml
check "kubernetes-validate --strict (k8s $K8S_VERSION): all-options render" validate "$tmp/all-on.yaml"
check "kubernetes-validate --strict (k8s $K8S_VERSION): crds.keep=false/jobImage render" validate "$tmp/variant.yaml"

shopt -s nullglob
job_files=(examples/*.yaml examples/*.yml deploy/examples/*.yaml deploy/examples/*.yml)
shopt -u nullglob
if [ ${#job_files[@]} -eq 0 ]; then
  echo "skip: no job manifests under examples/ or deploy/examples/"
  skipped=$((skipped + 1))
fi
job_file() { validate "$1" && job_envelope "$1"; }
for f in "${job_files[@]}"; do
  check "$f: built-in kinds validate (k8s $K8S_VERSION, strict), DistBeliefJob envelope" job_file "$f"
done

echo "manifests: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
