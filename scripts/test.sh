#!/usr/bin/env bash
# The whole test suite. Everything builds in release mode, once: the tests
# train real models, and clippy shares the release build's proc-macros.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all --check
echo "== cargo clippy" >&2
cargo clippy --release --locked --workspace --all-targets -- -D warnings
echo "== cargo test" >&2
cargo test --release --locked --workspace
