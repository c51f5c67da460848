# SPDX-License-Identifier: Apache-2.0
"""Builds the benchmark report of `make bench` from the JSON the benchmark
programs wrote: results/bench/{network,training-<rate>,tta,kernels,transport,
daemon,training,tta_latency}.json -> report.md, report.json and PNG charts in the same
folder, and a short summary on stdout. The emulated network's figures come
first (the headline); the loopback ones follow.

    /usr/bin/python3 bench/report.py --dir results/bench

Any input may be missing (its section then says so). The targets of the
training comparison (microd at 0.1 % against every DDP variant) are checked
here and reported as met or MISSED with the measured reason."""
import argparse
import json
import math
import os
import statistics
import sys

BASELINE = "ddp"
SPARSE = "microd-micro-0.1%"
FLOOR = "no-communication"
CONTROLLERS = {"hist (ours)": "microd-micro-1%", "paper": "microd-micro-1%-paper"}
LOSS_TOLERANCE = 0.05  # relative, against dense DDP
MIN_BYTES_RATIO = 100.0

NOTE = ("All figures come from one machine: every process and daemon shares its CPU cores and "
        "talks over loopback, so time per step mixes compute and communication on the same cores. "
        "On a real network the dense methods' time grows with bytes / bandwidth (dense DDP sends "
        "about 2 (n-1)/n x 4 bytes per parameter per step), while the compute part stays; bytes "
        "per step is the hardware-independent figure.")


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare_methods(training):
    """One row per method with its ratios to dense DDP (speed-up = DDP time /
    method time; bytes ratio = DDP bytes / method bytes; loss ratio = method
    loss / DDP loss)."""
    methods = {m["name"]: m for m in training.get("methods", [])}
    base = methods.get(BASELINE)
    floor = methods.get(FLOOR)
    rows = []
    for m in training.get("methods", []):
        row = {"name": m["name"], "error": m.get("error")}
        if not m.get("error"):
            row.update(step_ms=m["step_ms"], bytes=m["bytes_per_process_per_step"],
                       test_loss=m["test_loss"], diverged_at=m.get("diverged_at"))
            if base and not base.get("error"):
                row["speedup"] = ratio(base["step_ms"], m["step_ms"])
                row["bytes_ratio"] = ratio(base["bytes_per_process_per_step"],
                                           m["bytes_per_process_per_step"]) \
                    if m["bytes_per_process_per_step"] > 0 else None
                row["loss_ratio"] = ratio(m["test_loss"], base["test_loss"])
            if floor and not floor.get("error") and m["name"] != FLOOR:
                row["communication_ms"] = m["step_ms"] - floor["step_ms"]
            if "daemon" in m:
                row["daemon_ms"] = {k: 1000 * v for k, v in m["daemon"]["seconds_per_step"].items()}
                row["payload_bytes"] = m["daemon"]["payload_bytes_sent_per_step"]
        rows.append(row)
    return rows


def cre_series(training, bucket=None):
    """CRE against step for each controller: the largest sparse bucket's
    history ([step, cre, selected, budget] rows) and the mean from step 2
    over every sparse bucket's history."""
    methods = {m["name"]: m for m in training.get("methods", [])}
    out = {}
    for label, name in CONTROLLERS.items():
        m = methods.get(name)
        if not m or m.get("error") or "daemon" not in m or not m["daemon"]["history"]:
            continue
        hist = m["daemon"]["history"]
        chosen = bucket if bucket in hist else max(hist, key=lambda b: (len(hist[b]), b))
        from2 = [h[1] for rows in hist.values() for h in rows if h[0] >= 2]
        out[label] = {"method": name, "bucket": chosen,
                      "steps": [h[0] for h in hist[chosen]], "cre": [h[1] for h in hist[chosen]],
                      "mean_cre_from_step_2": statistics.mean(from2) if from2 else None}
    return out


def check_targets(rows):
    """The issue's targets for microd at 0.1 %: faster than every DDP variant,
    >= 100x fewer bytes than dense DDP, test loss within 5 % of dense DDP's."""
    by = {r["name"]: r for r in rows}
    s = by.get(SPARSE)
    if not s or s.get("error") or BASELINE not in by or by[BASELINE].get("error"):
        return [{"target": "microd at 0.1 % against DDP", "met": False,
                 "value": "not measured", "reason": (s or {}).get("error") or "missing runs"}]
    ddp = [r for r in rows if r["name"].startswith("ddp") and not r.get("error")]
    slowest_win = min(ddp, key=lambda r: r["step_ms"])
    t = []
    faster = all(s["step_ms"] < r["step_ms"] for r in ddp)
    reason = ""
    if not faster and "daemon_ms" in s:
        d = s["daemon_ms"]
        reason = (f"the fastest DDP variant ({slowest_win['name']}) takes {slowest_win['step_ms']:.0f} ms; "
                  f"microd's step {s['step_ms']:.0f} ms = daemon local sum {d['localSum']:.0f} + "
                  f"selection {d['select']:.0f} + exchange {d['exchange']:.0f} + write-back "
                  f"{d['writeback']:.0f} ms per step summed over buckets"
                  + (f" (and {d['negotiate']:.0f} ms waiting for the other nodes and the "
                     f"coordinator)" if "negotiate" in d else "")
                  + ", the rest is the training process's compute and hook overhead")
        if "communication_ms" in s:
            reason += f" (step minus the no-communication floor: {s['communication_ms']:.0f} ms)"
    t.append({"target": "microd 0.1 % step faster than every DDP variant", "met": faster,
              "value": f"{s['step_ms']:.1f} ms vs fastest DDP {slowest_win['name']} "
                       f"{slowest_win['step_ms']:.1f} ms", "reason": reason})
    br = s.get("bytes_ratio")
    t.append({"target": f"microd 0.1 % sends >= {MIN_BYTES_RATIO:.0f}x fewer bytes than dense DDP",
              "met": br is not None and br >= MIN_BYTES_RATIO,
              "value": f"{br:.0f}x fewer" if br else "n/a", "reason": ""})
    lr = s.get("loss_ratio")
    ok = lr is not None and math.isfinite(lr) and lr <= 1 + LOSS_TOLERANCE
    t.append({"target": "microd 0.1 % test loss within 5 % of dense DDP's", "met": ok,
              "value": f"{s['test_loss']:.4f} vs {by[BASELINE]['test_loss']:.4f} "
                       f"({100 * (lr - 1):+.1f} %)" if lr else "n/a",
              "reason": "" if ok else "fewer coordinates updated per step: after a fixed, short "
                        "number of steps the sparse run has applied less of the gradient"})
    return t


NETWORK_RATES = ("10gbit", "1gbit", "100mbit")
TRAINING_RATES = ("1gbit", "100mbit")
TTA_SPARSE = "microd-micro-1%"


def network_rows(network):
    """Per rate: the measured link, every method's step (first step apart)
    and its ratios to Gloo's dense allreduce and to the local floor."""
    out = []
    for rate, rr in network.get("rates", {}).items():
        m = rr.get("methods", {})
        gloo = m.get("gloo", {}).get("ms")
        floor = m.get("floor", {}).get("ms")
        row = {"rate": rate, "link": rr.get("link", {}), "methods": {}, "targets": rr.get("targets", [])}
        for name, r in m.items():
            if "error" in r:
                row["methods"][name] = {"error": r["error"]}
                continue
            row["methods"][name] = {
                "ms": r["ms"], "first_ms": r["first_ms"],
                "vs_gloo": ratio(gloo, r["ms"]) if name != "gloo" else 1.0,
                "vs_floor": ratio(r["ms"], floor) if name != "floor" else 1.0,
                "split": r.get("split_ms_per_step")}
        # Why the micro 0.1 % targets are missed where they are: its split,
        # and what the floor allows (a step cannot beat it).
        s = row["methods"].get("microd-micro-0.1%")
        if s and "ms" in s and gloo and floor:
            row["best_possible_vs_gloo"] = gloo / floor
        out.append(row)
    order = {r: i for i, r in enumerate(NETWORK_RATES)}
    return sorted(out, key=lambda r: order.get(r["rate"], len(order)))


def network_training_targets(rows, rate):
    """At 100 Mbit/s: microd's step >= 5x faster than DDP's, within 1.15x of
    the no-communication floor (the fastest microd variant)."""
    by = {r["name"]: r for r in rows if not r.get("error")}
    ddp, floor = by.get(BASELINE), by.get(FLOOR)
    micro = [r for r in rows if r["name"].startswith("microd-micro") and not r.get("error")]
    if rate != "100mbit" or not ddp or not floor or not micro:
        return []
    best = min(micro, key=lambda r: r["step_ms"])
    speedup = ddp["step_ms"] / best["step_ms"]
    over = best["step_ms"] / floor["step_ms"]
    return [{"target": "microd's step >= 5x faster than DDP's at 100 Mbit/s", "met": speedup >= 5,
             "value": f"{speedup:.1f}x ({best['name']} {best['step_ms']:.0f} ms vs DDP "
                      f"{ddp['step_ms']:.0f} ms)", "reason": ""},
            {"target": "microd's step within 1.15x of the no-communication floor at 100 Mbit/s",
             "met": over <= 1.15,
             "value": f"{over:.2f}x ({best['step_ms']:.0f} ms vs {floor['step_ms']:.0f} ms)",
             "reason": "" if over <= 1.15 else
             "the daemons' passes over the gradient (selection, write-back) share the cores the "
             "training processes compute on (4 nodes on this machine's 2 cores)"}]


def time_to_accuracy(tta):
    """Each method's test accuracy against training seconds; the target:
    microd (1 %) reaches the accuracy DDP has at the end of its budget in at
    most a third of DDP's time."""
    curves = {m["name"]: m["curve"] for m in tta.get("methods", []) if m.get("curve")}
    out = {"curves": curves, "config": tta.get("config", {}), "targets": []}
    ddp, micro = curves.get(BASELINE), curves.get(TTA_SPARSE)
    errors = {m["name"]: m.get("error") for m in tta.get("methods", []) if m.get("error")}
    out["errors"] = errors
    if ddp and micro:
        goal = ddp[-1][2]
        ddp_time = ddp[-1][0]
        # When microd's curve first reaches the goal: linear between the two
        # evaluations around the crossing (at the first one if it starts above).
        reached = None
        for (t0, _, a0), (t1, _, a1) in zip([micro[0]] + micro[:-1], micro):
            if a1 >= goal:
                reached = t1 if a1 == a0 or a0 >= goal else t0 + (goal - a0) / (a1 - a0) * (t1 - t0)
                break
        out["ddp_final_accuracy"] = goal
        out["ddp_seconds"] = ddp_time
        out["micro_seconds_to_goal"] = reached
        met = reached is not None and reached <= ddp_time / 3
        out["targets"].append({
            "target": "microd (1 %) reaches DDP's final test accuracy in <= 1/3 of DDP's time "
                      "(between evaluations: linear)",
            "met": met,
            "value": (f"{reached:.0f} s vs DDP's {ddp_time:.0f} s for {100 * goal:.1f} % "
                      f"({ddp_time / reached:.1f}x sooner)" if reached else
                      f"not reached within the budget (DDP: {100 * goal:.1f} % after "
                      f"{ddp_time:.0f} s; microd ended at {100 * micro[-1][2]:.1f} %)"),
            "reason": ""})
    return out


def time_to_target(tta):
    """A run with --target-accuracy (time to a fixed accuracy, e.g. at a
    50 ms round trip): per method the training seconds and steps to reach
    it; the target: every microd method within 1/4 of DDP's time."""
    cfg = tta.get("config", {})
    goal = cfg.get("target_accuracy", 0)
    rows = []
    for m in tta.get("methods", []):
        row = {"name": m["name"], "error": m.get("error"), "step_ms": m.get("step_ms"),
               "reached": m.get("reached"), "curve": m.get("curve", [])}
        rows.append(row)
    ddp = next((r for r in rows if r["name"] == BASELINE), None)
    out = {"config": cfg, "goal": goal, "rows": rows, "targets": []}
    ddp_s = ddp["reached"][0] if ddp and ddp.get("reached") else None
    for r in rows:
        if r["reached"] and ddp_s:
            r["vs_ddp"] = ddp_s / r["reached"][0]
        if not r["name"].startswith("microd"):
            continue
        if ddp_s is None:
            value = (f"DDP did not reach {100 * goal:.0f} % within the budget: no baseline"
                     if ddp and not ddp.get("error") else "DDP's run failed: no baseline")
            met = False
        elif not r["reached"]:
            last = r["curve"][-1][2] if r["curve"] else 0
            value = (f"not reached within the budget (ended at {100 * last:.1f} %)"
                     if not r["error"] else f"FAILED: {r['error']}")
            met = False
        else:
            met = r["reached"][0] <= ddp_s / 4
            value = (f"{r['reached'][0]:.0f} s ({r['reached'][1]} steps) vs DDP's {ddp_s:.0f} s "
                     f"({ddp['reached'][1]} steps): {ddp_s / r['reached'][0]:.2f}x sooner")
        out["targets"].append({"target": f"{r['name']} reaches {100 * goal:.0f} % test accuracy "
                                         "in <= 1/4 of DDP's training time",
                               "met": met, "value": value, "reason": ""})
    return out


def fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def times(v, spec):
    """A ratio as '2.50x', or '-' when there is none."""
    return "-" if v is None else format(v, spec) + "x"


def latency_rows(latency):
    """Per link (rate and round trip) and workload: Gloo, microd and the
    floor, each microd figure beside Gloo's and the floor from the same run,
    with microd's rounds per step."""
    rows = []
    for config, cr in latency.get("latency", {}).items():
        for workload, methods in cr.get("workloads", {}).items():
            gloo = methods.get("gloo", {}).get("ms")
            floor = methods.get("floor", {}).get("ms")
            row = {"config": config, "rate": cr["rate"],
                   "rtt_ms": cr.get("link", {}).get("rtt_ms_median"), "workload": workload,
                   "methods": {}}
            for name, r in methods.items():
                m = dict(r)
                if "ms" in r and gloo and name.startswith("microd"):
                    m["vs_gloo"] = gloo / r["ms"]
                if "ms" in r and floor and name.startswith("microd"):
                    m["vs_floor"] = r["ms"] / floor
                row["methods"][name] = m
            rows.append(row)
    return rows


def render_latency(report):
    rows = report.get("latency")
    if not rows:
        return []
    L = ["", "### Latency: round trips and many buckets", "",
         "Per link (rate, measured round trip) and workload (buckets x floats, every bucket "
         "submitted at once and then waited for): Gloo = torch.distributed's Gloo, one async "
         "`all_reduce` per bucket; microd's rounds per step beside its time "
         "(`bench/network/run.py --latency`).", "",
         "| link | workload | Gloo dense | micro 1 % | micro 0.1 % | floor |",
         "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        cells = [f"{row['rate']}, RTT {fmt(row['rtt_ms'], '.1f')} ms", row["workload"]]
        for name in ("gloo", "microd-micro-1%", "microd-micro-0.1%", "floor"):
            r = row["methods"].get(name)
            if not r:
                cells.append("-")
            elif "error" in r:
                cells.append("FAILED")
            elif name in ("gloo", "floor"):
                cells.append(f"{r['ms']:,.0f} ms")
            else:
                cells.append(f"{r['ms']:,.0f} ms ({r.get('vs_gloo', 0):.1f}x faster, "
                             f"{r.get('rounds_per_step', 0)} rounds)")
        L.append("| " + " | ".join(cells) + " |")
    return L


def render_seal(seal):
    """The sealed data plane's cost (bench/network/run.py --seal-cost)."""
    if not seal:
        return []
    s = seal["seal"]
    link = s.get("link", {})
    L = ["", "### The sealed data plane's cost", "",
         f"{seal['config']['nodes']} nodes, links at {s['rate']}, round trip "
         f"{fmt(link.get('rtt_ms_median'), '.1f')} ms, {s['workload']} floats: each method sealed "
         f"(the default with a token) and with `--seal=off`, in {seal['config']['repeats']} "
         f"turns each; the median step (`bench/network/run.py --seal-cost`).", "",
         "| method | sealed | unsealed | cost | target |", "|---|---:|---:|---:|---|"]
    for name, m in s["methods"].items():
        if "error" in m:
            L.append(f"| {name} | FAILED | | | |")
            continue
        L.append(f"| {name} | {m['sealed_ms']:,.1f} ms | {m['unsealed_ms']:,.1f} ms | "
                 f"{100 * m['cost']:+.1f} % | at most {100 * m['target']:.0f} %, "
                 f"{'met' if m['met'] else '**MISSED**'} |")
    return L


def render_tta_latency(tt):
    """The time-to-a-fixed-accuracy section (bench.sh --tta-latency)."""
    L = []
    if tt:
        cfg = tt["config"]
        L += ["", f"### Time to {100 * tt['goal']:.0f} % test accuracy, links at "
              f"{cfg.get('netlab_rate')}, {cfg.get('netlab_delay')} each way", "",
              f"Each method trains until {100 * tt['goal']:.0f} % test accuracy on the same "
              f"{cfg.get('eval_size', 2000):,} test images (evaluated every "
              f"{cfg.get('eval_every', 0):.0f} s of training; at most {cfg.get('budget', 0):.0f} s; "
              "`tta_latency.png`).", "",
              "| method | ms / step | reached after | steps | sooner than DDP |",
              "|---|---:|---:|---:|---:|"]
        for r in tt["rows"]:
            if r["error"]:
                L.append(f"| {r['name']} | FAILED: {r['error']} | | | |")
                continue
            got = r["reached"]
            L.append(f"| {r['name']} | {fmt(r['step_ms'], ',.0f')} | "
                     f"{f'{got[0]:.0f} s' if got else 'not reached'} | {got[1] if got else '-'} | "
                     f"{times(r.get('vs_ddp'), '.2f')} |")
        L.append("")
        for t in tt["targets"]:
            L.append(f"- {'met' if t['met'] else '**MISSED**'}: {t['target']}: {t['value']}")
    return L


def render_network(report):
    L = []
    net = report.get("network")
    if not net:
        return ["## On an emulated network", "",
                "Not run (no network.json: `make bench` runs it as root)."]
    c = net["config"]
    L += ["## On an emulated network (deploy/netlab)", "",
          f"{c['nodes']} nodes, each in a network namespace of its own, one training process "
          f"each; every node's link shaped both ways (tc tbf) with {c['delay']} of delay per "
          f"ingress; d = {c['size']:,} fp32 (one bucket); the step through the daemons, submit "
          f"to completion, median of {c['steps'] - 1} steps after the first (shown apart: it maps "
          f"the bucket's state). Gloo = torch.distributed's Gloo allreduce of the same tensor "
          f"plus its division by the world size. Floor = `e += g` plus one dense write of the "
          f"bucket on every node at once: the least memory traffic a step can have. All nodes "
          f"share this machine's cores.", "",
          "| link (measured) | Gloo dense | microd dense | micro 1 % | micro 0.1 % | floor |",
          "|---|---:|---:|---:|---:|---:|"]
    for row in net["rows"]:
        link = row["link"]
        cells = [f"{row['rate']} ({link.get('mb_per_s', 0):.1f} MB/s, RTT "
                 f"{link.get('rtt_ms_median', 0):.2f} ms)"]
        for name in ("gloo", "microd-dense", "microd-micro-1%", "microd-micro-0.1%", "floor"):
            r = row["methods"].get(name)
            if not r:
                cells.append("-")
            elif "error" in r:
                cells.append("FAILED")
            elif name in ("gloo", "floor"):
                cells.append(f"{r['ms']:,.1f} ms")
            elif name == "microd-dense":
                cells.append(f"{r['ms']:,.1f} ms ({r['vs_gloo']:.2f}x Gloo's speed)")
            else:
                cells.append(f"{r['ms']:,.1f} ms ({r['vs_gloo']:.1f}x faster; "
                             f"{r['vs_floor']:.2f}x floor)")
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "First steps (ms): " + "; ".join(
        f"{row['rate']}: " + ", ".join(f"{n} {r['first_ms']:,.0f}" for n, r in row["methods"].items()
                                        if "first_ms" in r) for row in net["rows"])]
    L += ["", "Where microd's step goes (daemon of node 0, ms per step, every step counted):", "",
          "| link | method | waiting | selection | exchange | write-back |", "|---|---|---:|---:|---:|---:|"]
    for row in net["rows"]:
        for name, r in row["methods"].items():
            sp = r.get("split")
            if sp:
                L.append(f"| {row['rate']} | {name} | {sp['negotiate']:.1f} | {sp['select']:.1f} | "
                         f"{sp['exchange']:.1f} | {sp['writeback']:.1f} |")
    L += ["", "Targets:", ""]
    for row in net["rows"]:
        for t in row["targets"]:
            line = (f"- {'met' if t['met'] else '**MISSED**'} ({row['rate']}): {t['what']}: "
                    f"{t['value']:.2f} (target {t['target']})")
            if not t["met"] and "faster than Gloo" in t["what"] and row.get("best_possible_vs_gloo"):
                line += (f". The local floor alone allows at most "
                         f"{row['best_possible_vs_gloo']:.1f}x here: the nodes' passes over the "
                         f"bucket share this machine's cores")
            L.append(line)
    L += render_latency(report)
    L += render_seal(report.get("seal"))
    for rate, tr in report.get("network_training", {}).items():
        cfg = tr["config"]
        L += ["", f"### Training on the emulated network at {rate}", "",
              f"{cfg['nodes']} processes (one per node), MLP of {tr['parameters'] / 1e6:.1f} M "
              f"parameters, batch {cfg['batch']} per process, {cfg['steps']} steps, medians after "
              f"{cfg['warmup']}.", "",
              "| method | ms / step | speed-up vs DDP | MB sent / step | fewer bytes | over the floor |",
              "|---|---:|---:|---:|---:|---:|"]
        floor = next((r for r in tr["rows"] if r["name"] == FLOOR and not r.get("error")), None)
        for r in tr["rows"]:
            if r.get("error"):
                L.append(f"| {r['name']} | FAILED: {r['error']} | | | | |")
                continue
            over = ratio(r["step_ms"], floor["step_ms"]) if floor else None
            L.append(f"| {r['name']} | {r['step_ms']:,.1f} | {times(r.get('speedup'), '.2f')} | "
                     f"{r['bytes'] / 1e6:.3f} | {times(r.get('bytes_ratio'), ',.0f')} | "
                     f"{times(over, '.2f')} |")
        if tr["targets"]:
            L.append("")
        for t in tr["targets"]:
            L.append(f"- {'met' if t['met'] else '**MISSED**'}: {t['target']}: {t['value']}"
                     + (f". Reason: {t['reason']}." if t["reason"] and not t["met"] else ""))
    tta = report.get("tta")
    if tta:
        cfg = tta["config"]
        L += ["", f"### Time to accuracy at {cfg.get('netlab_rate') or 'loopback'}", "",
              f"The same model and data, {cfg.get('budget', 0):.0f} s of training per method "
              f"(evaluations excluded), test accuracy on the same {cfg.get('eval_size', 2000):,} "
              f"test images every {cfg.get('eval_every', 0):.0f} s of training (`tta.png`).", "",
              "| method | steps | final test accuracy |", "|---|---:|---:|"]
        for name, curve in tta["curves"].items():
            L.append(f"| {name} | {curve[-1][1]} | {100 * curve[-1][2]:.1f} % |")
        for name, err in tta.get("errors", {}).items():
            L.append(f"| {name} | FAILED: {err} | |")
        L.append("")
        for t in tta["targets"]:
            L.append(f"- {'met' if t['met'] else '**MISSED**'}: {t['target']}: {t['value']}")
    L += render_tta_latency(report.get("tta_latency"))
    return L


def render_markdown(report):
    L = ["# microd benchmark report", ""]
    L += render_network(report)
    L += ["", "# On loopback", "", NOTE, ""]
    tr = report.get("training")
    if tr:
        c = tr["config"]
        L += ["## Training step: microd beside PyTorch DDP", "",
              f"{c['nodes']} processes, MLP of {tr['parameters'] / 1e6:.1f} M parameters on "
              f"Fashion-MNIST, batch {c['batch']} per process, SGD lr {c['lr']} momentum "
              f"{c['momentum']} (microd: the daemons' momentum correction), {c['steps']} steps, "
              f"times are medians after {c['warmup']} warm-up steps. Bytes: written to sockets per "
              f"process per step (trainer for DDP, its daemon for microd), from /proc/PID/io.", "",
              "| method | ms / step | speed-up vs DDP | MB sent / step | fewer bytes than DDP "
              "| test loss | loss vs DDP |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in tr["rows"]:
            if r.get("error"):
                L.append(f"| {r['name']} | FAILED: {r['error']} | | | | | |")
                continue
            L.append(f"| {r['name']} | {r['step_ms']:.1f} | {times(r.get('speedup'), '.2f')} | "
                     f"{r['bytes'] / 1e6:.3f} | {times(r.get('bytes_ratio'), ',.0f')} | "
                     f"{r['test_loss']:.4f} | {fmt(r.get('loss_ratio'), '.3f')} |")
        split = [r for r in tr["rows"] if "daemon_ms" in r]
        if split:
            L += ["", "Where microd's time goes (daemon, ms per step summed over buckets; waiting = "
                  "from ready on the node to the start of the bucket's step: the other nodes, the "
                  "coordinator, earlier buckets; payload = what the daemon handed to Gloo):", "",
                  "| method | waiting | local sum | selection | exchange | write-back "
                  "| payload MB / step |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
            for r in split:
                d = r["daemon_ms"]
                wait = f"{d['negotiate']:.1f}" if "negotiate" in d else "-"
                L.append(f"| {r['name']} | {wait} | {d['localSum']:.1f} | "
                         f"{d['select']:.1f} | {d['exchange']:.1f} | {d['writeback']:.1f} | "
                         f"{r['payload_bytes'] / 1e6:.3f} |")
        L += ["", "### Targets (microd at 0.1 %)", ""]
        for t in tr["targets"]:
            L.append(f"- {'met' if t['met'] else '**MISSED**'}: {t['target']}: {t['value']}"
                     + (f". Reason: {t['reason']}." if t["reason"] and not t["met"] else ""))
        if tr.get("cre"):
            L += ["", "## Compression-ratio error over the same training run (micro, 1 %)", "",
                  "| controller | mean CRE from step 2 | bucket plotted |", "|---|---:|---|"]
            for label, s in tr["cre"].items():
                L.append(f"| {label} | {fmt(s['mean_cre_from_step_2'] and 100 * s['mean_cre_from_step_2'], '.2f')} % "
                         f"| {s['bucket']} |")
        L += ["", "Charts: `time_per_step.png`, `bytes_per_step.png`, `cre.png`."]
    else:
        L += ["## Training step", "", "Not run (no training.json)."]
    k = report.get("kernels")
    L += ["", "## Kernels (one node's pass over a bucket)", ""]
    if k:
        L += [f"d = {k['size']:,}, n = {k['nodes']}, {k['isa']}", "",
              "| density | pass | ms | baseline | ratio | target |", "|---|---|---:|---|---:|---|"]
        for r in k["results"]:
            L.append(f"| {100 * r['density']:g} % | {r['pass']} | {r['ms']:.2f} | {r['baseline']} | "
                     f"{r['ratio']:.2f}x | {r['target']} |")
    else:
        L.append("Not run (no kernels.json).")
    t = report.get("transport")
    L += ["", "## Transport (raw MiCRO step over Gloo, no daemon)", ""]
    if t:
        L += [f"{t['nodes']} processes, d = {t['size']:,}", "",
              "| method | density | ms / step | faster than dense ring | payload bytes / node "
              "| fewer bytes |", "|---|---:|---:|---:|---:|---:|"]
        for r in t["results"]:
            L.append(f"| {r['method']} | {100 * r['density']:g} % | {r['ms_per_step']:.1f} | "
                     f"{r['speedup_vs_dense_ring']:.1f}x | {r['payload_bytes_per_node']:,.0f} | "
                     f"{times(r['bytes_ratio_vs_dense'] or None, ',.0f')} |")
    else:
        L.append("Not run (no transport.json).")
    d = report.get("daemon")
    L += ["", "## Through the daemons", ""]
    if d:
        L += [f"- 1,024-element round trip: median {d['latency_1024_median_us']:.0f} us, p99 "
              f"{d['latency_1024_p99_us']:.0f} us (target median <= 200 us)"]
        if d.get("transport_1024_median_us"):
            L += [f"- the transport alone in the same run (back-to-back allreduces of the same "
                  f"1,024 floats over microd's Gloo transport, no daemon): median "
                  f"{d['transport_1024_median_us']:.0f} us, p99 {d['transport_1024_p99_us']:.0f} us"]
        L += [
              f"- {d['size']:,} elements at 0.1 %: {d['daemon_step_ms']:.1f} ms per step through "
              f"the daemons vs {d['raw_step_ms']:.1f} ms raw ({100 * d['overhead']:+.0f} %, target "
              f"<= 10 %)"]
    else:
        L.append("Not run (no daemon.json).")
    return "\n".join(L) + "\n"


def plot(report, out_dir):
    """PNG charts; returns the files written (none without matplotlib or data)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []

    def save(fig, ax, name):
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    tta = report.get("tta")
    if tta and tta["curves"]:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for name, curve in tta["curves"].items():
            ax.plot([c[0] for c in curve], [100 * c[2] for c in curve], marker="o", ms=3,
                    label=name, color="tab:gray" if name.startswith("ddp") else None)
        if tta.get("ddp_final_accuracy"):
            ax.axhline(100 * tta["ddp_final_accuracy"], ls=":", color="tab:gray")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"Time to accuracy, links at {tta['config'].get('netlab_rate') or 'loopback'}")
        written.append(save(fig, ax, "tta.png"))
    tt = report.get("tta_latency")
    if tt and any(r["curve"] for r in tt["rows"]):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for r in tt["rows"]:
            if r["curve"]:
                ax.plot([c[0] for c in r["curve"]], [100 * c[2] for c in r["curve"]], marker="o",
                        ms=3, label=r["name"], color="tab:gray" if r["name"] == BASELINE else None)
        ax.axhline(100 * tt["goal"], ls=":", color="tab:gray")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("test accuracy (%)")
        cfg = tt["config"]
        ax.set_title(f"Time to {100 * tt['goal']:.0f} %, links at {cfg.get('netlab_rate')}, "
                     f"{cfg.get('netlab_delay')} each way")
        written.append(save(fig, ax, "tta_latency.png"))
    tr = report.get("training")
    if not tr:
        return written
    rows = [r for r in tr["rows"] if not r.get("error")]
    for key, label, fname, log in (("step_ms", "ms per step (median)", "time_per_step.png", False),
                                   ("bytes", "bytes sent per process per step", "bytes_per_step.png",
                                    True)):
        data = [r for r in rows if r[key] and r[key] > 0]
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        colors = ["tab:gray" if r["name"].startswith(("ddp", "no-")) else "tab:blue" for r in data]
        ax.barh([r["name"] for r in data], [r[key] for r in data], color=colors)
        if log:
            ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.set_title(f"{label}: DDP variants (gray) and microd (blue)")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if tr.get("cre"):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for label, s in tr["cre"].items():
            ax.plot(s["steps"], [100 * c for c in s["cre"]], label=f"{label} ({s['bucket']})")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xlabel("step")
        ax.set_ylabel("CRE |K - k| / k (%)")
        ax.set_title("Compression-ratio error per step, micro at 1 %")
        written.append(save(fig, ax, "cre.png"))
    return written


def build_report(dir_):
    report = {"note": NOTE}
    network = load(os.path.join(dir_, "network.json"))
    if network:
        report["network"] = {"config": network["config"], "rows": network_rows(network)}
    latency = load(os.path.join(dir_, "latency.json"))
    if latency:
        report["latency"] = latency_rows(latency)
    report["seal"] = load(os.path.join(dir_, "seal.json"))
    report["network_training"] = {}
    for rate in TRAINING_RATES:
        t = load(os.path.join(dir_, f"training-{rate}.json"))
        if t:
            rows = compare_methods(t)
            params = next((m["parameters"] for m in t["methods"] if "parameters" in m), 0)
            report["network_training"][rate] = {"config": t["config"], "parameters": params,
                                                "rows": rows,
                                                "targets": network_training_targets(rows, rate)}
    tta = load(os.path.join(dir_, "tta.json"))
    if tta:
        report["tta"] = time_to_accuracy(tta)
    tta = load(os.path.join(dir_, "tta_latency.json"))
    if tta:
        report["tta_latency"] = time_to_target(tta)
    for name in ("kernels", "transport", "daemon"):
        report[name] = load(os.path.join(dir_, f"{name}.json"))
    training = load(os.path.join(dir_, "training.json"))
    if training:
        rows = compare_methods(training)
        params = next((m["parameters"] for m in training["methods"] if "parameters" in m), 0)
        report["training"] = {"config": training["config"], "parameters": params, "rows": rows,
                              "targets": check_targets(rows), "cre": cre_series(training)}
    return report


def summary(report):
    lines = []
    for row in (report.get("network") or {}).get("rows", []):
        parts = [f"{n} {r['ms']:,.1f}" for n, r in row["methods"].items() if "ms" in r]
        lines.append(f"  network {row['rate']}: " + ", ".join(parts) + " ms/step")
        for t in row["targets"]:
            lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {row['rate']}: {t['what']}: "
                         f"{t['value']:.2f} (target {t['target']})")
    for rate, tr in report.get("network_training", {}).items():
        for t in tr["targets"]:
            lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")
    for key in ("tta", "tta_latency"):
        for t in (report.get(key) or {}).get("targets", []):
            lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")
    tr = report.get("training")
    if tr:
        for r in tr["rows"]:
            if r.get("error"):
                lines.append(f"  {r['name']:<24} FAILED")
            else:
                lines.append(f"  {r['name']:<24} {r['step_ms']:9.1f} ms/step "
                             f"{times(r.get('speedup'), '6.2f'):>7}  {r['bytes'] / 1e6:9.3f} MB/step "
                             f"{times(r.get('bytes_ratio'), ',.0f'):>7} fewer  loss {r['test_loss']:.4f}")
        for t in tr["targets"]:
            lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']}")
        for label, s in tr["cre"].items():
            lines.append(f"  CRE {label}: mean from step 2 "
                         f"{fmt(s['mean_cre_from_step_2'] and 100 * s['mean_cre_from_step_2'], '.2f')} %")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="results/bench")
    args = ap.parse_args(argv)
    report = build_report(args.dir)
    with open(os.path.join(args.dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.dir, "report.md"), "w") as f:
        f.write(render_markdown(report))
    charts = plot(report, args.dir)
    print(summary(report))
    print(f"  report: {os.path.join(args.dir, 'report.md')} (+ report.json, {len(charts)} charts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
