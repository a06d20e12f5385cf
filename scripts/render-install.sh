#!/usr/bin/env bash
# Regenerates deploy/install.yaml: the Helm chart rendered with its default
# values into namespace distbelief-system, behind a Namespace object, so that
# `kubectl apply -f deploy/install.yaml` installs the operator without Helm.
#
#   scripts/render-install.sh            rewrite deploy/install.yaml
#   scripts/render-install.sh --stdout   print the render instead (what
#                                        scripts/check-manifests.sh compares
#                                        the committed file with)
#
# The render depends on the Helm version, so it uses the pinned one that
# scripts/setup.sh installs into .tools/bin.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM="${HELM:-$PWD/.tools/bin/helm}"
[ -x "$HELM" ] || { echo "render-install: $HELM missing; run scripts/setup.sh" >&2; exit 1; }

NAMESPACE=distbelief-system

render() {
  cat <<HEADER
# The distbelief operator, CRD included, for \`kubectl apply -f deploy/install.yaml\`.
# GENERATED, do not edit: it is charts/distbelief rendered with default values.
# Regenerate with scripts/render-install.sh, which runs
#   helm template distbelief charts/distbelief --namespace $NAMESPACE
# and puts the Namespace below in front. scripts/check-manifests.sh fails
# when this file differs from a fresh render.
apiVersion: v1
kind: Namespace
metadata:
  name: $NAMESPACE
  labels:
    app.kubernetes.io/part-of: distbelief
    # The operator pod meets the restricted Pod Security Standard. Run jobs
    # in namespaces of their own, not in this one.
    pod-security.kubernetes.io/enforce: restricted
HEADER
  "$HELM" template distbelief charts/distbelief --namespace "$NAMESPACE"
}

case "${1:-}" in
  --stdout) render ;;
  "")
    out=deploy/install.yaml
    tmp=$(mktemp "$out.XXXXXX")
    trap 'rm -f "$tmp"' EXIT
    render >"$tmp"
    chmod 0644 "$tmp"
    mv "$tmp" "$out"
    trap - EXIT
    echo "render-install: wrote $out" >&2
    ;;
  *) echo "usage: $0 [--stdout]" >&2; exit 2 ;;
esac
