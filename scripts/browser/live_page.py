#!/usr/bin/env python3
"""Watches a running job's live page in headless Chromium, through
chromedriver's W3C WebDriver protocol (standard library only), and prints
what it saw as JSON for the test to judge:

  * `readings`: the accuracy the page showed and the examples of its point;
  * `points`: how many curve points the page drew, over time;
  * `before`: the killed replica's row just before the kill, and `replica`:
    each row the page showed for it after the kill, whenever it changed
    (state, process number, processes so far, the restarts cell);
  * `unreported`: any row whose state or process differed from the status
    document the page had rendered (none, if the page shows only what the
    coordinator reported);
  * `killed`: the replica process it killed (SIGKILL), by PID.

It judges nothing by whether it caught a short-lived state: a restart can be
over between two polls, so the test asserts on the records the page keeps
(process number, restart count, the events list).

It kills replica --replica of the `distbelief train` process --train-pid
(one of that process's children, found in /proc) once the page has drawn
--kill-after points, and saves a screenshot at the end.

usage: live_page.py URL --train-pid PID --replica N --screenshot PNG
       live_page.py --saved live.html    (what the saved page shows, as JSON)
"""

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """A WebDriver session on a chromedriver this script started."""

    def __init__(self):
        driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
        browser = shutil.which("chromium") or "/usr/bin/chromium"
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="distbelief-chromium-")
        self.proc = subprocess.Popen(
            [driver, f"--port={self.port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 20
        while True:
            try:
                self.call("GET", "/status")
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("chromedriver did not start")
                time.sleep(0.1)
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": browser,
                        "args": [
                            "--headless=new",
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            f"--user-data-dir={self.profile}",
                            "--window-size=1400,1900",
                        ],
                    },
                }
            }
        }
        self.session = self.call("POST", "/session", caps)["sessionId"]

    def call(self, method, path, body=None, timeout=30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)["value"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"WebDriver {method} {path}: {e.read().decode()[:500]}")

    def go(self, url):
        self.call("POST", f"/session/{self.session}/url", {"url": url})

    def js(self, script):
        return self.call(
            "POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []}
        )

    def screenshot(self, path):
        png = self.call("GET", f"/session/{self.session}/screenshot")
        with open(path, "wb") as f:
            f.write(base64.b64decode(png))

    def close(self):
        try:
            self.call("DELETE", f"/session/{self.session}", timeout=10)
        except Exception:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


READ = """
const acc = document.getElementById('accuracy');
const row = document.querySelector('#replicas tr[data-replica="%d"]');
return {
  accuracy: acc.textContent,
  value: acc.dataset.value || null,
  examples: acc.dataset.examples || null,
  points: Number(document.getElementById('curve-time').dataset.points || 0),
  state: row ? row.dataset.state : null,
  incarnation: row ? Number(row.dataset.incarnation) : null,
  incarnations: row ? Number(row.dataset.incarnations) : null,
  restarts: row ? row.cells[7].textContent : null,
  reported: (typeof lastView === 'undefined' || !lastView) ? null
    : (lastView.replicas.find(r => r.replica === %d) || null),
  job: document.getElementById('job').textContent,
  badge: document.getElementById('state').textContent,
  events: Array.from(document.querySelectorAll('#events li')).map(li => li.textContent),
};
"""


def replica_pid(train_pid, replica):
    """The live `worker --replica N` child of the train process."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != train_pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"worker" in args and b"--replica" in args:
            i = args.index(b"--replica")
            if args[i + 1] == str(replica).encode():
                return int(d)
    return None


def row_of(r):
    """The watched replica's row as [state, process, processes, restarts cell]."""
    if r["state"] is None:
        return None
    return [r["state"], r["incarnation"], r["incarnations"], r["restarts"]]


def saved(path):
    """What a saved page (live.html) shows when opened from disk."""
    d = Driver()
    try:
        d.go("file://" + os.path.abspath(path))
        deadline = time.time() + 10
        while True:
            r = d.js(READ % (0, 0))
            if r["job"] != "distbelief" or time.time() > deadline:
                break
            time.sleep(0.1)
        r["note"] = d.js("return document.getElementById('note').textContent;")
    finally:
        d.close()
    json.dump(r, sys.stdout)
    print()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--saved":
        return saved(sys.argv[2])
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--train-pid", type=int, required=True)
    p.add_argument("--replica", type=int, default=1)
    p.add_argument("--kill-after", type=int, default=3, help="curve points before the kill")
    p.add_argument("--screenshot", required=True)
    p.add_argument("--seconds", type=float, default=90)
    a = p.parse_args()

    seen = {
        "readings": [],
        "points": [],
        "before": None,
        "replica": [],
        "unreported": [],
        "killed": None,
        "job": None,
    }
    d = Driver()
    try:
        # Polled faster than a person's page, for more readings.
        d.go(a.url + "?every=100")
        deadline = time.time() + a.seconds
        killed_at = None
        while time.time() < deadline:
            r = d.js(READ % (a.replica, a.replica))
            seen["job"] = r["job"]
            row = row_of(r)
            rep = r["reported"]
            if row and (
                rep is None
                or rep["state"] != row[0]
                or rep["incarnation"] != row[1]
                or rep["incarnations"] != row[2]
            ):
                seen["unreported"].append({"shown": row, "reported": rep})
            if not seen["points"] or seen["points"][-1][1] != r["points"]:
                seen["points"].append([round(time.time(), 2), r["points"]])
            if r["value"] and r["examples"]:
                reading = [int(r["examples"]), r["accuracy"], float(r["value"])]
                if not seen["readings"] or seen["readings"][-1] != reading:
                    seen["readings"].append(reading)
            if killed_at is None and r["points"] >= a.kill_after and r["state"] == "training":
                pid = replica_pid(a.train_pid, a.replica)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
                    seen["killed"] = pid
                    seen["before"] = row
            elif killed_at is not None and row:
                if not seen["replica"] or seen["replica"][-1] != row:
                    seen["replica"].append(row)
            # Done watching once the new process trains (whether or not a
            # poll caught it restarting) and the curve has moved on.
            back = (
                killed_at is not None
                and row
                and row[2] > seen["before"][2]
                and row[0] in ("training", "done")
            )
            if "finished" in r["badge"] or (back and r["points"] >= a.kill_after + 4):
                break
            time.sleep(0.05)
        time.sleep(0.5)
        last = d.js(READ % (a.replica, a.replica))
        seen["final"] = last
        d.screenshot(a.screenshot)
    finally:
        d.close()
    json.dump(seen, sys.stdout)
    print()


if __name__ == "__main__":
    main()
