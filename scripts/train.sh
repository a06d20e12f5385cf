#!/usr/bin/env bash
# The main job: a local Fashion-MNIST training run with Downpour SGD,
# 2 parameter-server shards and 2 replicas. Extra arguments go to
# `distbelief train` (for example --summary-json summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked -p distbelief
exec ./target/release/distbelief train examples/fashion-mnist-downpour.yaml "$@"
