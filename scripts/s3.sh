#!/usr/bin/env bash
# An S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's
# server, installed into .tools/venv by scripts/setup.sh --test.
#
#   scripts/s3.sh up     start it (or reuse the one this script started), make
#                        the bucket `distbelief-test`, and print only
#                          export DISTBELIEF_S3_ENDPOINT=http://127.0.0.1:PORT
#                        so that   eval "$(scripts/s3.sh up)"   points the tests at it
#   scripts/s3.sh down   stop the server this script started (by its PID)
#
# moto keeps objects in memory and checks no signature: it stands in for a
# store's protocol, not its security. Jobs reach it with the variables a
# user would set for any S3-compatible store (see docs/job-spec.md):
#   AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true, AWS_ACCESS_KEY_ID,
#   AWS_SECRET_ACCESS_KEY, AWS_REGION.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${DISTBELIEF_S3_STATE:-$HOME/.cache/distbelief-s3}
SERVER="$ROOT/.tools/venv/bin/moto_server"
PY="$ROOT/.tools/venv/bin/python"
BUCKET=distbelief-test

die() { printf 's3.sh: %s\n' "$*" >&2; exit 1; }

alive() {
  [ -f "$STATE/pid" ] && [ -f "$STATE/port" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null
}

# answers PORT: whether the server answers HTTP on PORT.
answers() {
  "$PY" -c 'import sys, urllib.request
urllib.request.urlopen("http://127.0.0.1:%s/" % sys.argv[1], timeout=2)' "$1" 2>/dev/null
}

up() {
  [ -x "$SERVER" ] || die "$SERVER missing: run scripts/setup.sh --test (it installs moto[server])"
  mkdir -p "$STATE"
  if ! alive; then
    port=$("$PY" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    setsid "$SERVER" -H 127.0.0.1 -p "$port" > "$STATE/server.log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
    echo "$port" > "$STATE/port"
    for _ in $(seq 1 100); do
      answers "$port" && break
      kill -0 "$(cat "$STATE/pid")" 2>/dev/null || { cat "$STATE/server.log" >&2; die "moto_server exited"; }
      sleep 0.2
    done
    answers "$port" || { cat "$STATE/server.log" >&2; die "moto_server did not answer on 127.0.0.1:$port in 20 s"; }
  fi
  port=$(cat "$STATE/port")
  # moto checks no signature, so an unsigned PUT makes the bucket (again is fine).
  "$PY" -c 'import sys, urllib.request
urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:%s/%s" % (sys.argv[1], sys.argv[2]), method="PUT"), timeout=10)' "$port" "$BUCKET" ||
    die "could not make the bucket $BUCKET"
  echo "export DISTBELIEF_S3_ENDPOINT=http://127.0.0.1:$port"
}

down() {
  if alive; then
    kill "$(cat "$STATE/pid")"
  fi
  rm -f "$STATE/pid" "$STATE/port"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) die "usage: scripts/s3.sh up|down" ;;
esac
