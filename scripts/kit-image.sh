#!/usr/bin/env bash
# Builds the distbelief image (the operator's and the job pods') for the
# Kubernetes kit, from host files and without Docker, with the kit's
# mkimage.py:
#
#   scripts/kit-image.sh OUT.tar REF       e.g. REF=localhost/distbelief:dev
#   "$(scripts/kit.sh path)/load-image.sh" OUT.tar
#   # then: --set image.repository=localhost/distbelief,image.tag=dev,image.pullPolicy=Never
#
# Like the Dockerfile's image: /usr/local/bin/distbelief (from
# target/release/distbelief, or $DISTBELIEF_BINARY) is the entrypoint, the
# Fashion-MNIST files are at /usr/share/datasets/fashion-mnist, Adult's at
# /usr/local/share/datasets/adult, MovieLens 100k joined by the binary at
# /usr/local/share/datasets/movielens-100k, and the synthetic CTR set (made
# here by the binary, 10^6 rows) at /usr/local/share/datasets/synthetic-ctr, the user is
# 65532:65532, and /etc/ssl/certs/ca-certificates.crt is copied when the host
# has it. The binary's shared libraries and dynamic loader come from the host
# (ldd), so the image runs the binary exactly as built here.
#
# DISTBELIEF_IMAGE_DATA=none builds the image without any data set: the
# binary alone, as for a job whose data comes from a volume.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { printf 'kit-image.sh: %s\n' "$*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: scripts/kit-image.sh OUT.tar REF   (REF e.g. localhost/distbelief:dev)"
OUT=$1 REF=$2
BIN=${DISTBELIEF_BINARY:-$ROOT/target/release/distbelief}
DATA=/usr/share/datasets/fashion-mnist
ADULT=/usr/local/share/datasets/adult
CA=/etc/ssl/certs/ca-certificates.crt

[ -f "$BIN" ] || die "no binary at $BIN: build it first (cargo build --release -p distbelief)"
[ -x "$BIN" ] || die "$BIN is not executable"
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -f "$DATA/$f" ] || die "no $DATA/$f: run scripts/setup.sh (it installs dataset-fashion-mnist)"
done
WITH_DATA=1
[ "${DISTBELIEF_IMAGE_DATA:-all}" = none ] && WITH_DATA=
KIT=$("$ROOT/scripts/kit.sh" path) || exit 1
CTR=/usr/local/share/datasets/synthetic-ctr
MOVIELENS=/usr/local/share/datasets/movielens-100k
CTR_DIR=$(mktemp -d)
ML_DIR=$(mktemp -d)
chmod 0755 "$CTR_DIR" "$ML_DIR"
trap 'rm -rf "$CTR_DIR" "$ML_DIR"' EXIT
if [ -n "$WITH_DATA" ]; then
  [ -f "$ADULT/adult.parquet.brotli" ] || die "no $ADULT/adult.parquet.brotli: run scripts/setup.sh (it fetches Adult)"
  [ -f "$MOVIELENS/MovieLens100k_users.parquet.brotli" ] || die "no MovieLens 100k in $MOVIELENS: run scripts/setup.sh (it fetches it)"
  "$BIN" data synth-ctr --out "$CTR_DIR" >/dev/null 2>&1 || die "distbelief data synth-ctr failed"
  "$BIN" data movielens --from "$MOVIELENS" --out "$ML_DIR" >/dev/null 2>&1 || die "distbelief data movielens failed"
  chmod 0644 "$ML_DIR"/*.parquet
fi
PYTHON=$(command -v python3) || die "mkimage.py needs python3"

args=(
  --out "$OUT.tmp" --ref "$REF" --user 65532:65532
  --add "$BIN:/usr/local/bin/distbelief" --libs-of "$BIN"
  --entrypoint '["/usr/local/bin/distbelief"]'
)
[ -z "$WITH_DATA" ] || args+=(--add "$DATA:$DATA" --add "$ADULT:$ADULT" --add "$CTR_DIR:$CTR" --add "$ML_DIR:$MOVIELENS")
[ -f "$CA" ] && args+=(--add "$CA:$CA")

rm -f "$OUT.tmp"
timeout 600 "$PYTHON" "$KIT/mkimage.py" "${args[@]}" >&2 || { rm -f "$OUT.tmp"; die "mkimage.py failed"; }
mv -f "$OUT.tmp" "$OUT"
