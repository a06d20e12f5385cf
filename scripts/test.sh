#!/usr/bin/env bash
# The whole test suite. Everything builds in release mode, once: the tests
# train real models, and clippy shares the release build's proc-macros.
#
# After fmt and clippy (which stop the run at once when they fail) come three
# suites that all run even if an earlier one failed: the manifest checks, the
# cargo tests and the kind end-to-end suite (which skips where there is no
# Docker engine or kind). The last line adds up all three:
#   tests: N passed, N failed, N skipped
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all --check
echo "== cargo clippy" >&2
cargo clippy --release --locked --workspace --all-targets -- -D warnings

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0

echo "== manifests (scripts/check-manifests.sh)" >&2
scripts/check-manifests.sh 2>&1 | tee -a "$log" || status=1

echo "== cargo test" >&2
# --all-targets: unit, integration and binary tests (the crates have no doctests).
cargo test --release --locked --workspace --all-targets 2>&1 | tee -a "$log" || status=1

echo "== e2e (tests/e2e/run.sh)" >&2
tests/e2e/run.sh 2>&1 | tee -a "$log" || status=1

# cargo prints one "test result:" line per test binary; the two scripts print
# one "<name>: N passed, N failed, N skipped" line each.
awk '/^test result:/ { p += $4; f += $6; s += $8 }
     /^(manifests|e2e): [0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$/ { p += $2; f += $4; s += $6 }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0) }' "$log" || status=1
# A suite can fail without a failed count (a compile error, a crashed script).
exit "$status"
