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
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --all-targets: unit, integration and binary tests (the crates have no doctests).
cargo test --release --locked --workspace --all-targets 2>&1 | tee "$log"
awk '/^test result:/ { p += $4; f += $6; s += $8 }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log"
