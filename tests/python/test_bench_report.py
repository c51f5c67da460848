# SPDX-License-Identifier: Apache-2.0
"""The benchmark report generator (bench/report.py) on small fixed inputs,
and the smoke run of `make bench`'s training comparison feeding it."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402


def training_methods():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "training_run", os.path.join(ROOT, "bench", "training", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [m[0] for m in mod.METHODS]

BUILD = os.environ.get("MICROD_BUILD_DIR", os.path.join(ROOT, "build"))


def method(name, ms, sent, loss, daemon=None, error=None):
    m = {"name": name, "step_ms": ms, "bytes_per_process_per_step": sent, "test_loss": loss,
         "parameters": 1000}
    if daemon:
        m["daemon"] = daemon
    if error:
        m = {"name": name, "error": error}
    return m


def daemon(history, payload=100.0, secs=(0.001, 0.002, 0.003, 0.004)):
    return {"payload_bytes_sent_per_step": payload,
            "seconds_per_step": dict(zip(("localSum", "select", "exchange", "writeback"), secs)),
            "mean_cre": [], "history": history}


def training(methods):
    return {"config": {"nodes": 4, "steps": 10, "warmup": 2, "batch": 8, "width": 16, "lr": 0.02,
                       "momentum": 0.9, "smoke": False}, "methods": methods}


def test_ratios_are_against_dense_ddp():
    rows = report.compare_methods(training([
        method("no-communication", 50.0, 0.0, 2.0),
        method("ddp", 200.0, 6000.0, 1.0),
        method("ddp-fp16", 100.0, 3000.0, 1.02),
        method("microd-micro-0.1%", 80.0, 30.0, 1.04, daemon({})),
    ]))
    by = {r["name"]: r for r in rows}
    assert by["ddp"]["speedup"] == 1.0 and by["ddp"]["bytes_ratio"] == 1.0
    assert by["ddp-fp16"]["speedup"] == pytest.approx(2.0)
    assert by["ddp-fp16"]["bytes_ratio"] == pytest.approx(2.0)
    assert by["microd-micro-0.1%"]["bytes_ratio"] == pytest.approx(200.0)
    assert by["microd-micro-0.1%"]["loss_ratio"] == pytest.approx(1.04)
    assert by["microd-micro-0.1%"]["communication_ms"] == pytest.approx(30.0)
    assert by["microd-micro-0.1%"]["daemon_ms"]["exchange"] == pytest.approx(3.0)
    assert by["no-communication"]["bytes_ratio"] is None  # sends nothing: no ratio
    assert "communication_ms" not in by["no-communication"]


def test_targets_met_and_missed():
    ok = report.check_targets(report.compare_methods(training([
        method("ddp", 200.0, 6000.0, 1.0),
        method("ddp-powersgd-r1", 120.0, 60.0, 1.1),
        method("microd-micro-0.1%", 80.0, 30.0, 1.04, daemon({})),
    ])))
    assert [t["met"] for t in ok] == [True, True, True]
    missed = report.check_targets(report.compare_methods(training([
        method("no-communication", 50.0, 0.0, 2.0),
        method("ddp", 200.0, 6000.0, 1.0),
        method("ddp-powersgd-r1", 70.0, 60.0, 1.1),
        method("microd-micro-0.1%", 80.0, 120.0, 1.06, daemon({})),
    ])))
    assert [t["met"] for t in missed] == [False, False, False]
    # The speed target names the faster DDP variant and the measured split.
    assert "ddp-powersgd-r1" in missed[0]["value"]
    assert "exchange 3" in missed[0]["reason"] and "floor: 30 ms" in missed[0]["reason"]
    assert "waiting" not in missed[0]["reason"]  # this daemon reported no waiting time
    assert missed[1]["value"] == "50x fewer"
    # With the daemons' waiting time, the reason gives it too.
    waited = daemon({})
    waited["seconds_per_step"]["negotiate"] = 0.025
    again = report.check_targets(report.compare_methods(training([
        method("ddp", 200.0, 6000.0, 1.0),
        method("microd-micro-0.1%", 250.0, 30.0, 1.0, waited),
    ])))
    assert "25 ms waiting for the other nodes" in again[0]["reason"]


def test_missing_or_failed_sparse_run_is_a_missed_target():
    t = report.check_targets(report.compare_methods(training([
        method("ddp", 200.0, 6000.0, 1.0),
        method("microd-micro-0.1%", 0, 0, 0, error="exit status 1"),
    ])))
    assert len(t) == 1 and not t[0]["met"] and "exit status 1" in t[0]["reason"]


def test_cre_series_uses_the_largest_bucket_and_the_mean_from_step_2():
    hist = {"small": [[0, 5.0, 1, 1], [1, 1.0, 1, 1], [2, 0.5, 1, 1]],
            "big": [[0, 9.0, 1, 1], [1, 2.0, 1, 1], [2, 0.1, 1, 1], [3, 0.3, 1, 1]]}
    s = report.cre_series(training([
        method("microd-micro-1%", 10, 10, 1, daemon(hist)),
        method("microd-micro-1%-paper", 10, 10, 1,
               daemon({"b": [[0, 1.0, 1, 1], [1, 1.0, 1, 1], [2, 0.4, 1, 1]]})),
    ]))
    assert s["hist (ours)"]["bucket"] == "big"
    assert s["hist (ours)"]["steps"] == [0, 1, 2, 3]
    assert s["hist (ours)"]["mean_cre_from_step_2"] == pytest.approx((0.5 + 0.1 + 0.3) / 3)
    assert s["paper"]["mean_cre_from_step_2"] == pytest.approx(0.4)


def test_report_files_from_a_folder(tmp_path):
    (tmp_path / "training.json").write_text(json.dumps(training([
        method("ddp", 200.0, 6000.0, 1.0),
        method("microd-micro-0.1%", 80.0, 30.0, 1.04, daemon({"b": [[0, 0.2, 1, 1], [2, 0.1, 1, 1]]})),
        method("microd-micro-1%", 90.0, 300.0, 1.01, daemon({"b": [[0, 0.2, 1, 1], [2, 0.1, 1, 1]]})),
        method("microd-hard-1%", 0, 0, 0, error="exit status 2"),
    ])))
    (tmp_path / "daemon.json").write_text(json.dumps({
        "nodes": 4, "latency_1024_median_us": 3450.0, "latency_1024_p99_us": 12000.0,
        "transport_1024_median_us": 2900.0, "transport_1024_p99_us": 8000.0, "size": 1000, "daemon_step_ms": 110.5, "raw_step_ms": 100.4, "overhead": 0.1006}))
    assert report.main(["--dir", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "| microd-micro-0.1% | 80.0 | 2.50x | 0.000 | 200x | 1.0400 | 1.040 |" in md
    assert "microd-hard-1% | FAILED: exit status 2" in md
    assert "Not run (no kernels.json)" in md and "median 3450 us" in md
    assert "no daemon): median 2900 us, p99 8000 us" in md  # the transport alone beside it
    assert "loopback" in md  # says these are one machine's CPU figures
    data = json.loads((tmp_path / "report.json").read_text())
    assert [t["met"] for t in data["training"]["targets"]] == [True, True, True]
    for png in ("time_per_step.png", "bytes_per_step.png", "cre.png"):
        assert (tmp_path / png).stat().st_size > 1000


def network_fixture():
    def m(ms, first, split=None):
        r = {"ms": ms, "first_ms": first, "step_ms": [first, ms, ms]}
        if split:
            r["split_ms_per_step"] = split
        return r
    split = {"negotiate": 1.0, "localSum": 0.0, "select": 30.0, "exchange": 5.0, "writeback": 10.0}
    return {"config": {"nodes": 4, "size": 1000, "steps": 3, "delay": "0.05ms"},
            "rates": {"1gbit": {"link": {"mb_per_s": 119.5, "rtt_ms_median": 0.27},
                                "methods": {"gloo": m(1300.0, 1310.0),
                                            "microd-dense": m(1350.0, 1500.0, split),
                                            "microd-micro-1%": m(120.0, 400.0, split),
                                            "microd-micro-0.1%": m(90.0, 160.0, split),
                                            "floor": m(70.0, 55.0)},
                                "targets": [{"what": "micro 0.1 % faster than Gloo dense",
                                             "value": 1300 / 90, "target": ">= 25x",
                                             "met": False}]}}}


def test_network_section_ratios_and_the_floor_bound():
    rows = report.network_rows(network_fixture())
    assert len(rows) == 1
    m = rows[0]["methods"]
    assert m["microd-dense"]["vs_gloo"] == pytest.approx(1300 / 1350)
    assert m["microd-micro-0.1%"]["vs_gloo"] == pytest.approx(1300 / 90)
    assert m["microd-micro-0.1%"]["vs_floor"] == pytest.approx(90 / 70)
    # No step can beat the local floor: the best a sparse step could be here.
    assert rows[0]["best_possible_vs_gloo"] == pytest.approx(1300 / 70)
    md = report.render_markdown({"network": {"config": network_fixture()["config"], "rows": rows}})
    assert "1,350.0 ms (0.96x Gloo's speed)" in md
    assert "90.0 ms (14.4x faster; 1.29x floor)" in md
    assert "allows at most 18.6x here" in md


def test_latency_section_ratios_and_rounds():
    latency = {"latency": {"1gbit@25ms": {"rate": "1gbit", "delay": "25ms",
                                          "link": {"rtt_ms_median": 50.9},
                                          "workloads": {"16x1597315": {
                                              "gloo": {"ms": 2983.5},
                                              "microd-micro-0.1%": {"ms": 240.0,
                                                                    "rounds_per_step": 3},
                                              "floor": {"ms": 98.6}}}}}}
    rows = report.latency_rows(latency)
    assert len(rows) == 1
    m = rows[0]["methods"]["microd-micro-0.1%"]
    assert m["vs_gloo"] == pytest.approx(2983.5 / 240.0)
    assert m["vs_floor"] == pytest.approx(240.0 / 98.6)
    md = report.render_markdown({"network": {"config": network_fixture()["config"],
                                             "rows": report.network_rows(network_fixture())},
                                 "latency": rows})
    assert "| 1gbit, RTT 50.9 ms | 16x1597315 | 2,984 ms | - | 240 ms (12.4x faster, 3 rounds) |" in md


def test_time_to_accuracy_target():
    tta = {"config": {"netlab_rate": "100mbit", "budget": 100, "eval_every": 10},
           "methods": [{"name": "ddp", "curve": [[0, 0, 0.1], [50, 4, 0.5], [100, 8, 0.6]]},
                       {"name": "microd-micro-1%",
                        "curve": [[0, 0, 0.1], [20, 30, 0.55], [30, 45, 0.62], [100, 150, 0.8]]}]}
    t = report.time_to_accuracy(tta)
    # 0.6 is crossed between 0.55 at 20 s and 0.62 at 30 s: at 20 + 5/7 * 10 s.
    assert t["ddp_final_accuracy"] == 0.6
    assert t["micro_seconds_to_goal"] == pytest.approx(20 + 10 * 5 / 7)
    assert t["targets"][0]["met"] is True
    tta["methods"][1]["curve"][2] = [40, 45, 0.62]
    assert report.time_to_accuracy(tta)["micro_seconds_to_goal"] == pytest.approx(20 + 20 * 5 / 7)
    assert report.time_to_accuracy(tta)["targets"][0]["met"] is False
    tta["methods"][1]["curve"] = [[0, 0, 0.1], [100, 150, 0.5]]
    t = report.time_to_accuracy(tta)
    assert not t["targets"][0]["met"] and "not reached" in t["targets"][0]["value"]


def test_time_to_a_fixed_accuracy_target():
    tta = {"config": {"netlab_rate": "1gbit", "netlab_delay": "25ms", "target_accuracy": 0.8,
                      "budget": 1000, "eval_every": 10},
           "methods": [{"name": "ddp", "step_ms": 4000, "reached": [800.0, 200],
                        "curve": [[0, 0, 0.1], [800, 200, 0.81]]},
                       {"name": "microd-micro-1%", "step_ms": 1000, "reached": [190.0, 190],
                        "curve": [[0, 0, 0.1], [190, 190, 0.8]]},
                       {"name": "microd-micro-0.1%", "step_ms": 900, "reached": [270.0, 300],
                        "curve": [[0, 0, 0.1], [270, 300, 0.8]]}]}
    t = report.time_to_target(tta)
    assert [x["met"] for x in t["targets"]] == [True, False]
    assert "4.21x sooner" in t["targets"][0]["value"] and "300 steps" in t["targets"][1]["value"]
    md = "\n".join(report.render_tta_latency(t))
    assert "| microd-micro-1% | 1,000 | 190 s | 190 | 4.21x |" in md, md
    # A method that never gets there, and a DDP that never does: both missed.
    tta["methods"][2].pop("reached")
    assert "not reached" in report.time_to_target(tta)["targets"][1]["value"]
    tta["methods"][0].pop("reached")
    assert not any(x["met"] for x in report.time_to_target(tta)["targets"])


def test_smoke_run_of_make_bench(tmp_path):
    """`make bench` end to end at tiny sizes (scripts/bench.sh --smoke): the
    benchmark programs, every method of the training comparison (2 processes,
    4 steps) and the report built from them."""
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "bench.sh"), BUILD, "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "training.json").read_text())
    assert [m["name"] for m in data["methods"]] == training_methods()
    for m in data["methods"]:
        assert "error" not in m, m
        assert m["steps"] == 4 and m["test_loss"] > 0
        dense = 4 * m["parameters"]  # one copy of the gradient, in bytes
        if m["name"] == "no-communication":
            assert m["bytes_per_process_per_step"] < 1000
        elif m["name"].startswith("ddp"):
            assert m["bytes_per_process_per_step"] > 0.25 * dense, m["name"]
        else:  # sparse through the daemons (the smoke lowers their dense floor)
            assert 0 < m["daemon"]["payload_bytes_sent_per_step"] < 0.5 * dense, m["name"]
            assert m["daemon"]["history"], m["name"]
    rep = json.loads((tmp_path / "report.json").read_text())
    for section in ("kernels", "transport", "daemon", "training"):
        assert rep[section], section
    md = (tmp_path / "report.md").read_text()
    assert "ddp-powersgd-r4" in md
    for png in ("time_per_step.png", "bytes_per_step.png", "cre.png"):
        assert (tmp_path / png).exists(), png
    if os.geteuid() != 0:
        assert "network namespaces need root" in r.stdout
        return
    # The emulated network's section (root): every method at the smoke's one rate.
    assert "Not run" not in md
    net = json.loads((tmp_path / "network.json").read_text())
    methods = net["rates"]["1gbit"]["methods"]
    assert set(methods) == {"gloo", "microd-dense", "microd-micro-1%", "microd-micro-0.1%", "floor"}
    for name, m in methods.items():
        assert "error" not in m, (name, m)
        assert len(m["step_ms"]) == 3 and m["ms"] > 0, name
    assert net["rates"]["1gbit"]["link"]["mb_per_s"] > 0
    lat = json.loads((tmp_path / "latency.json").read_text())
    for workload, methods in lat["latency"]["1gbit@5ms"]["workloads"].items():
        for name, m in methods.items():
            assert "error" not in m, (workload, name, m)
        assert methods["microd-micro-0.1%"]["rounds_per_step"] >= 2, workload
    assert "### Latency: round trips and many buckets" in md
    for rate in ("1gbit", "100mbit"):
        t = json.loads((tmp_path / f"training-{rate}.json").read_text())
        assert t["config"]["netlab_rate"] == rate
        for m in t["methods"]:
            assert "error" not in m, (rate, m)
    tta = json.loads((tmp_path / "tta.json").read_text())
    assert [m["name"] for m in tta["methods"]] == ["ddp", "microd-micro-1%"]
    for m in tta["methods"]:
        assert len(m["curve"]) >= 2, m  # the start and the end of the budget at least
    assert "## On an emulated network" in md and "### Time to accuracy at 100mbit" in md
    assert (tmp_path / "tta.png").exists()
    tl = json.loads((tmp_path / "tta_latency.json").read_text())
    assert [m["name"] for m in tl["methods"]] == ["ddp", "microd-micro-1%", "microd-micro-0.1%"]
    assert tl["config"]["netlab_delay"] == "5ms" and tl["config"]["target_accuracy"] == 0.2
    for m in tl["methods"]:
        assert "error" not in m and m["curve"], m
    assert "### Time to 20 % test accuracy" in md
