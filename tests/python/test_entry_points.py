# SPDX-License-Identifier: Apache-2.0
"""Every Python program of the repository answers --help as a newcomer runs
it: Debian's interpreter, from another folder, with no PYTHONPATH and the
package not installed. Tried as a new user would, two did not: the training
benchmark's help had a bare % (a traceback), and the Fashion-MNIST example
could not import microd."""
import os
import subprocess
import tempfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROGRAMS = [
    "bench/elastic/accuracy.py",
    "bench/elastic/recovery.py",
    "bench/network/gloo_allreduce.py",
    "bench/network/run.py",
    "bench/report.py",
    "bench/sparsity/sweep.py",
    "bench/training/run.py",
    "bench/training/worker.py",
    "deploy/netlab/probe.py",
    "examples/fashion_mnist/report.py",
    "examples/fashion_mnist/train.py",
]


def test_the_list_names_every_program():
    # A program (a file with a __main__ block) missing here is untested.
    found = []
    for top in ("bench", "deploy", "examples"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(folder, f)
                if f.endswith(".py") and "__main__" in open(path).read():
                    found.append(os.path.relpath(path, ROOT))
    assert sorted(found) == sorted(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_exits_0(program):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MICROD_LIBRARY", "MICROD_BUILD_DIR")}
    with tempfile.TemporaryDirectory() as elsewhere:
        r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, program), "--help"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:500]
