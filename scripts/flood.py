#!/usr/bin/env python3
"""Floods a local run's gRPC ports with connections that say nothing, as an
outsider that can reach them would (docs/security.md, "Connecting").

    distbelief train examples/fashion-mnist-downpour.yaml --out runs/flood &
    python3 scripts/flood.py --pid $! --run runs/flood

It finds the ports the run's processes listen on (skipping their metrics
ports, named in the run's logs), opens up to --rate connections a second to
each from --source (another loopback address, as another pod would have),
holds at most --max per port, and stops when the run ends or after --for
seconds. It prints what it did as JSON.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import time


def descendants(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                         capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def metrics_ports(run):
    ports = set()
    for root, _, files in os.walk(os.path.join(run, "logs")):
        for f in files:
            try:
                text = open(os.path.join(root, f), errors="replace").read()
            except OSError:
                continue
            ports |= {int(p) for p in re.findall(r"metrics on http://[\d.]+:(\d+)", text)}
    return ports


def grpc_ports(pid, run):
    pids = set(descendants(pid))
    skip = metrics_ports(run)
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = set()
    for line in out.splitlines():
        m = re.search(r"[\d.*]+:(\d+)\s.*pid=(\d+)", line)
        if m and int(m.group(2)) in pids and int(m.group(1)) not in skip:
            ports.add(int(m.group(1)))
    return ports


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True, help="the `distbelief train` process")
    ap.add_argument("--run", required=True, help="its run directory (--out)")
    ap.add_argument("--source", default="127.0.0.2")
    ap.add_argument("--rate", type=float, default=2000.0, help="connections a second, per port")
    ap.add_argument("--max", type=int, default=3000, help="connections held, per port")
    ap.add_argument("--for", dest="seconds", type=float, default=300.0)
    a = ap.parse_args()
    held, opened, failed = {}, 0, 0
    start, scanned, ports = time.time(), 0.0, set()
    while time.time() - start < a.seconds:
        try:
            os.kill(a.pid, 0)
        except ProcessLookupError:
            break
        if time.time() - scanned > 0.1:
            ports, scanned = grpc_ports(a.pid, a.run), time.time()
        for p in ports:
            conns = held.setdefault(p, [])
            for _ in range(max(1, int(a.rate / 20))):
                if len(conns) >= a.max:
                    break
                s = socket.socket()
                s.setblocking(False)
                try:
                    s.bind((a.source, 0))
                    s.connect_ex(("127.0.0.1", p))
                    conns.append(s)
                    opened += 1
                except OSError:
                    failed += 1
                    s.close()
        time.sleep(0.05)
    print(json.dumps({"ports": sorted(held), "opened": opened, "failed": failed,
                      "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
