# SPDX-License-Identifier: Apache-2.0
"""The reports that judge accuracy against dense: the demo's (examples/
fashion_mnist/report.py) and the density sweep's (bench/sparsity/sweep.py),
on small fixed runs."""
import importlib.util
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = "/usr/bin/python3"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def demo_run(label, accuracy):
    return {"label": label, "world_size": 4, "steps": 40, "seed": 0,
            "loss": [2.0 - i / 40 for i in range(40)], "step_seconds": [0.01] * 40,
            "eval": [{"step": 20, "accuracy": accuracy - 0.05, "loss": 0.6},
                     {"step": 40, "accuracy": accuracy, "loss": 0.4}],
            "samples": [] if label == "dense" else
            [{"step": 20, "selected": 10, "budget": 10, "count": 1000, "threshold": 0.1,
              "cre": 0.0}],
            "final_accuracy": accuracy, "final_test_loss": 0.4}


def run_demo_report(tmp_path, sparse_accuracy, dense_accuracy):
    paths = []
    for label, acc in (("micro", sparse_accuracy), ("dense", dense_accuracy)):
        p = tmp_path / f"{label}.json"
        p.write_text(json.dumps(demo_run(label, acc)))
        paths.append(str(p))
    out = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "fashion_mnist", "report.py"),
                          *paths, "--out", str(tmp_path / "results")],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("micro:")]


def test_demo_says_below_dense_without_a_plus_sign(tmp_path):
    # `make demo` printed "micro: +0.41 accuracy points below dense".
    lines = run_demo_report(tmp_path, 0.8659, 0.8700)
    assert len(lines) == 1
    assert "0.41 accuracy points below dense" in lines[0]
    assert "+" not in lines[0] and "-0.41" not in lines[0]
    assert lines[0].endswith("-> met")


def test_demo_says_above_dense_and_misses_past_one_point(tmp_path):
    assert "0.30 accuracy points above dense" in run_demo_report(tmp_path, 0.8730, 0.8700)[0]
    line = run_demo_report(tmp_path, 0.8550, 0.8700)[0]
    assert "1.50 accuracy points below dense" in line and line.endswith("-> MISSED")


def sweep_row(accuracies, dense, evals=None, failed=False):
    runs = []
    for i, acc in enumerate(accuracies):
        rec = {"failed": True, "diverged_at": 139} if failed else {
            "final_accuracy": acc,
            "eval": [{"step": s, "accuracy": a} for s, a in (evals or [])] or
            [{"step": 300, "accuracy": acc}]}
        runs.append({"seed": i, "record": rec, "dense": dense[i]})
    return runs


def test_sweep_targets_judge_the_defaults_against_dense_and_one_percent():
    sweep = load("bench/sparsity/sweep.py", "sweep")
    dense = [0.88, 0.87]
    rows = {
        ("micro", "hist", 0.01, "defaults"): sweep_row(
            [0.875, 0.868], dense, [(150, 0.75), (300, 0.87)]),
        ("micro", "hist", 0.001, "defaults"): sweep_row(
            [0.865, 0.850], dense, [(100, 0.70), (200, 0.745), (300, 0.86)]),
        ("micro", "hist", 0.001, "off"): sweep_row([0, 0], dense, failed=True),
        ("micro", "hist", 0.0003, "defaults"): sweep_row([0, 0], dense, failed=True),
    }
    lines = sweep.targets(rows, 150)
    one = [x for x in lines if "at 1 %" in x]
    assert len(one) == 1 and "-0.35 points from dense" in one[0] and one[0].endswith("met")
    tenth = [x for x in lines if "at 0.1 %" in x]
    # mean of -1.5 and -2.0 from dense: missed
    assert any("-1.75 points from dense" in x and x.endswith("MISSED") for x in tenth)
    # first evaluation at or past step 150 is 200 here; 1 % has none at 200
    assert not any("against 1 %" in x for x in tenth)
    rows[("micro", "hist", 0.01, "defaults")] = sweep_row(
        [0.875, 0.868], dense, [(100, 0.70), (200, 0.75), (300, 0.87)])
    tenth = [x for x in sweep.targets(rows, 150) if "at 0.1 %" in x]
    assert any("74.50 % at step 200 against 1 %'s 75.00 %" in x and x.endswith("met")
               for x in tenth)
    assert not any("remedy" in x or "'off'" in x for x in lines)  # only the defaults are judged
    bad = [x for x in lines if "at 0.03 %" in x]
    assert bad == ["- micro/hist at 0.03 % with the defaults: diverged or failed in 2 of 2 "
                   "runs (target: none) -> MISSED"]
