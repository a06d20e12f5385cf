#!/usr/bin/env python3
"""Prints the scalars of a run directory's TensorBoard event files as JSON,
{tag: [[step, value], ...]}, read with TensorBoard's own reader: the test
that the coordinator's files are what TensorBoard shows."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: scalars.py RUN_DIR")
    acc = event_accumulator.EventAccumulator(
        sys.argv[1], size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    out = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
