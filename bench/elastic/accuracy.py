# SPDX-License-Identifier: Apache-2.0
"""What a change of membership costs in accuracy: the demo's CNN on
Fashion-MNIST, 4 nodes x 2 processes (daemons on loopback), trained with
microd.torch.elastic for STEPS steps, uninterrupted and with node 2 lost at
step 20 (daemon and trainers killed: its residual is lost) and a new node
joining at step 40 (zero residual), for each seed. Prints each run's test
accuracy and the mean difference beside the seeds' own spread.

    /usr/bin/python3 bench/elastic/accuracy.py --seeds 1,2,3 --steps 600

The runs are the ones tests/python/test_elastic.py makes (its cluster and
its worker).
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

from conftest import Cluster  # noqa: E402
from test_elastic import ELASTIC_WORKER, accuracy_of, run_elastic  # noqa: E402
import pathlib  # noqa: E402


def one(seed, steps, elastic_run):
    extra = ("model=cnn", f"seed={seed}")
    if not elastic_run:
        cluster = Cluster(4, 2)
        try:
            results = cluster.run(ELASTIC_WORKER, [str(steps), *extra], timeout=1800)
        finally:
            cluster.stop()
        for code, out in results:
            if code != 0:
                raise SystemExit(f"accuracy.py: a trainer failed:\n{out[-2000:]}")
        return accuracy_of([out for _, out in results])
    cluster = Cluster(4, 2, args=("--min_nodes=3",))
    try:
        go = pathlib.Path(tempfile.mkdtemp(prefix="microd-acc-")) / "go"
        return accuracy_of(run_elastic(cluster, go, steps, 2, 20, 40, extra, timeout=1800))
    finally:
        cluster.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    print("| seed | uninterrupted | node lost at 20, one joined at 40 | difference |")
    print("|---:|---:|---:|---:|")
    plain, changed = [], []
    for seed in (int(s) for s in args.seeds.split(",")):
        plain.append(one(seed, args.steps, False))
        changed.append(one(seed, args.steps, True))
        print(f"| {seed} | {plain[-1]:.4f} | {changed[-1]:.4f} | "
              f"{100 * (changed[-1] - plain[-1]):+.2f} points |", flush=True)
    spread = statistics.pstdev(plain) * 100 if len(plain) > 1 else 0.0
    print(f"\nmean: uninterrupted {statistics.mean(plain):.4f}, with the changes "
          f"{statistics.mean(changed):.4f}: {100 * (statistics.mean(changed) - statistics.mean(plain)):+.2f}"
          f" points (the uninterrupted runs' spread across seeds: {spread:.2f} points, "
          f"{args.steps} steps)")


if __name__ == "__main__":
    sys.exit(main())
