# SPDX-License-Identifier: Apache-2.0
"""Which densities train, and with which remedies: Fashion-MNIST through a
local cluster (deploy/local/launch.sh), the demo's CNN or the training
benchmark's MLP, every combination of density x remedy x controller x
sparsifier x seed against dense averaging with the same seed and steps.

    /usr/bin/python3 bench/sparsity/sweep.py --build build --out results/sweep \\
        --model cnn --densities 0.01,0.003,0.001,0.0003 --remedies defaults,off,all

Per run: the final test accuracy and its difference from dense (same seed),
the step of a divergence (NaN/Inf) and its message, and the density actually
achieved over the run (the daemon's selected / elements, warm-up included).
Writes OUT/sweep.json, OUT/sweep.md (the table, with several seeds the mean
and the spread, and the test accuracy at each evaluation) and OUT/sweep.png
(accuracy against dense by density, one line per remedy; and the accuracy
curves). A finished run's JSON is reused (delete it to rerun); --cached
reports only what has run, running nothing.

Remedies (daemon flags beside --sparsifier, --controller and --density):
  defaults  nothing else: what the daemon applies by itself for the density
  off       --remedies=off: no warm-up, no clipping, no minimum k
  mc        --remedies=off --momentum_correction=0.9
  warmup    --remedies=off, 50 dense steps, then the density decays from 10x
            the target (at most 25 %) over 400 steps
  clip      --remedies=off --clip_norm=1.0
  all       mc + warmup + clip
A remedy NAME=FLAGS given to --remedies defines one more (flags split on
spaces). Every remedy except `off`, `warmup` and `clip` runs with momentum
correction 0.9 unless its flags set it (as `make demo` does): the training
side then applies no momentum of its own."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON = "/usr/bin/python3"
TRAIN = os.path.join(ROOT, "examples", "fashion_mnist", "train.py")


def warmup_flags(density):
    start = min(0.25, 10 * density)
    return ["--warmup_steps=50", f"--warmup_density={start:g}", "--warmup_decay_steps=400"]


def remedy_flags(name, density, custom):
    """Daemon flags of remedy `name` at `density`."""
    off = ["--remedies=off"]
    mc = ["--momentum_correction=0.9"]
    presets = {
        "defaults": mc,
        "off": off + ["--momentum_correction=0"],
        "mc": off + mc,
        "warmup": off + ["--momentum_correction=0"] + warmup_flags(density),
        "clip": off + ["--momentum_correction=0", "--clip_norm=1.0"],
        "all": off + mc + warmup_flags(density) + ["--clip_norm=1.0"],
    }
    if name in custom:
        flags = custom[name].split()
        if not any(f.startswith("--momentum_correction") for f in flags):
            flags = mc + flags
        return flags
    if name not in presets:
        raise SystemExit(f"sweep.py: unknown remedy {name!r} (known: {', '.join(presets)}; "
                         "or NAME=FLAGS)")
    return presets[name]


def run(label, daemon_flags, args, seed):
    """One training run; returns its record (from its JSON or its logs), or
    None with --cached when it has not run."""
    out = os.path.join(args.out, "runs", f"{label}.json")
    logs = os.path.join(args.out, "runs", f"{label}.logs")
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    if args.cached:
        return None
    os.makedirs(logs, exist_ok=True)
    cmd = [os.path.join(ROOT, "deploy", "local", "launch.sh"), "--nodes", str(args.nodes),
           "--local", "1", "--microd", os.path.join(args.build, "daemon", "microd"),
           "--logs", logs]
    # Rank 0 evaluates on the test set between steps while the others wait in
    # the next one: the MLP's evaluation (25 M parameters x 10,000 images on
    # one core) can pass the default 60 s deadline of an operation.
    for f in ["--timeout_ms=600000", *daemon_flags]:
        cmd += ["--daemon-arg", f]
    train = [PYTHON, TRAIN, "--model", args.model, "--seed", str(seed), "--label", label,
             "--out", out, "--evals", "4"]
    train += ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]
    if args.model == "mlp":
        # the training benchmark's: batch 8 per process, SGD lr 0.02
        train += ["--width", str(args.width), "--lr", str(args.lr or 0.02), "--batch", "8"]
    elif args.lr:
        train += ["--lr", str(args.lr)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"),
               MICROD_LIBRARY=os.path.join(args.build, "client", "libmicrod.so"),
               MICROCTL=os.path.join(args.build, "daemon", "microctl"), OMP_NUM_THREADS="1")
    print(f"  {label:<44} ", end="", flush=True)
    try:
        subprocess.run(cmd + ["--", *train], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        pass
    if os.path.exists(out):
        with open(out) as f:
            r = json.load(f)
        print(f"{100 * r['final_accuracy']:.2f} %")
        return r
    text = ""
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            text += f.read()
    m = re.search(r"step (\d+): NaN or Inf[^\n]*", text)
    r = {"label": label, "failed": True,
         "diverged_at": int(m.group(1)) if m else None,
         "error": m.group(0)[:200] if m else "no result: see " + logs}
    with open(out, "w") as f:
        json.dump(r, f)
    print("diverged at step %s" % r["diverged_at"] if m else "failed")
    return r


def achieved_density(r):
    s = [x for x in r.get("samples", []) if x.get("count")]
    return statistics.mean(x["selected"] / x["count"] for x in s) if s else None


def table(rows):
    """Markdown: one row per configuration, accuracy minus dense per seed."""
    md = ["| sparsifier | controller | density | remedy | accuracy | vs dense (points) | "
          "achieved density | diverged |", "|---|---|---:|---|---:|---:|---:|---|"]
    for key, runs in rows.items():
        sp, ctl, density, remedy = key
        ok = [r for r in runs if not r["record"].get("failed")]
        acc = [100 * r["record"]["final_accuracy"] for r in ok]
        diff = [100 * (r["record"]["final_accuracy"] - r["dense"]) for r in ok if r["dense"]]
        dens = [d for d in (achieved_density(r["record"]) for r in ok) if d is not None]
        div = [str(r["record"].get("diverged_at")) for r in runs if r["record"].get("failed")]

        def fmt(v, digits=2):
            if not v:
                return "-"
            if len(v) == 1:
                return f"{v[0]:.{digits}f}"
            return f"{statistics.mean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}"
        md.append(f"| {sp} | {ctl} | {100 * density:g} % | {remedy} | {fmt(acc)} | "
                  f"{fmt(diff)} | {'-' if not dens else f'{100 * statistics.mean(dens):.3f} %'} | "
                  f"{'steps ' + ', '.join(div) if div else 'no'} |")
    return md


def curves(rows):
    """Markdown: test accuracy at each evaluation step, mean over the seeds."""
    steps = sorted({e["step"] for runs in rows.values() for r in runs
                    for e in r["record"].get("eval", [])})
    md = ["| sparsifier | controller | density | remedy | " +
          " | ".join(f"step {s}" for s in steps) + " |", "|---|---|---:|---|" + "---:|" * len(steps)]
    for (sp, ctl, density, remedy), runs in rows.items():
        by_step = {}
        for r in runs:
            for e in r["record"].get("eval", []):
                by_step.setdefault(e["step"], []).append(100 * e["accuracy"])
        cells = [f"{statistics.mean(by_step[s]):.2f}" if s in by_step else "-" for s in steps]
        md.append(f"| {sp} | {ctl} | {100 * density:g} % | {remedy} | " + " | ".join(cells) + " |")
    return md


def targets(rows, at_step):
    """Markdown lines: each target beside the figure it is judged on. With
    the defaults (no flag beyond --density): the final accuracy within 1.0
    point of dense (mean over the seeds), and below 1 % density, within 1.0
    point of 1 % at the first evaluation at or past `at_step`."""
    def mean_eval(runs, step):
        acc = [100 * e["accuracy"] for r in runs for e in r["record"].get("eval", [])
               if e["step"] == step]
        return statistics.mean(acc) if acc else None
    md = []
    for (sp, ctl, density, remedy), runs in rows.items():
        if remedy != "defaults":
            continue
        name = f"{sp}/{ctl} at {100 * density:g} % with the defaults"
        ok = [r for r in runs if not r["record"].get("failed") and r["dense"]]
        if len(ok) < len(runs):
            md.append(f"- {name}: diverged or failed in {len(runs) - len(ok)} of {len(runs)} "
                      "runs (target: none) -> MISSED")
        if ok:
            diff = statistics.mean(100 * (r["record"]["final_accuracy"] - r["dense"]) for r in ok)
            md.append(f"- {name}: {diff:+.2f} points from dense at the end (target: within "
                      f"1.0) -> {'met' if diff >= -1.0 else 'MISSED'}")
        ref = rows.get((sp, ctl, 0.01, remedy))
        if density < 0.01 and ref and ok:
            steps = sorted({e["step"] for r in ok for e in r["record"].get("eval", [])})
            step = next((x for x in steps if x >= at_step), None)
            a, b = (mean_eval(ok, step), mean_eval(ref, step)) if step else (None, None)
            if a is not None and b is not None:
                md.append(f"- {name}: {a:.2f} % at step {step} against 1 %'s {b:.2f} % "
                          f"({a - b:+.2f}; target: within 1.0 by step {at_step}) -> "
                          f"{'met' if a - b >= -1.0 else 'MISSED'}")
    return md


def plot(rows, dense, dense_curves, title, path):
    """Accuracy minus dense against density, one line per (sparsifier,
    controller, remedy), divergences marked at the bottom; beside it the test
    accuracy curves of every configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    lines = {}
    for (sp, ctl, density, remedy), runs in rows.items():
        lines.setdefault((sp, ctl, remedy), []).append((density, runs))
    floor = -10.0
    for (sp, ctl, remedy), points in sorted(lines.items()):
        xs, ys, bad = [], [], []
        for density, runs in sorted(points):
            diff = [100 * (r["record"]["final_accuracy"] - r["dense"]) for r in runs
                    if not r["record"].get("failed") and r["dense"]]
            if diff:
                xs.append(100 * density)
                ys.append(max(floor, statistics.mean(diff)))
            elif any(r["record"].get("failed") for r in runs):
                bad.append(100 * density)
        name = remedy if (sp, ctl) == ("micro", "hist") else f"{sp}/{ctl} {remedy}"
        line, = a.plot(xs, ys, marker="o", label=name)
        if bad:
            a.plot(bad, [floor] * len(bad), marker="x", linestyle="", color=line.get_color(),
                   markersize=10)
    a.axhline(0, color="black", linewidth=0.8)
    a.axhline(-1, color="grey", linestyle="--", linewidth=0.8, label="target: within 1 point")
    a.set_xscale("log")
    a.set_xlabel("density (%)")
    a.set_ylabel("test accuracy minus dense (points); x: diverged")
    a.set_title(title, fontsize=9)
    a.legend(fontsize=7)
    for (sp, ctl, density, remedy), runs in sorted(rows.items()):
        r = runs[0]["record"]
        if r.get("eval"):
            b.plot([e["step"] for e in r["eval"]], [100 * e["accuracy"] for e in r["eval"]],
                   marker=".", label=f"{100 * density:g} % {sp}/{ctl} {remedy}")
    for seed, acc in sorted(dense.items()):
        if acc is not None and dense_curves.get(seed):
            e = dense_curves[seed]
            b.plot([x["step"] for x in e], [100 * x["accuracy"] for x in e], color="black",
                   linewidth=2, label="dense" if seed == min(dense) else None)
            break
    b.set_xlabel("step")
    b.set_ylabel("test accuracy (%), first seed")
    b.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "sweep"))
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--width", type=int, default=4096, help="--model mlp: its width")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--steps", type=int, default=0, help="train this many steps (not --epochs)")
    ap.add_argument("--lr", type=float, default=0, help="learning rate (0: the model's default)")
    ap.add_argument("--densities", default="0.01,0.003,0.001,0.0003")
    ap.add_argument("--remedies", default="defaults,off,all")
    ap.add_argument("--controllers", default="hist")
    ap.add_argument("--sparsifiers", default="micro")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--equal-steps", type=int, default=150,
                    help="compare below 1 %% with 1 %% at the first evaluation past this step")
    ap.add_argument("--cached", action="store_true",
                    help="run nothing: report the runs already in OUT/runs")
    args = ap.parse_args()
    custom = {}
    remedies = []
    for item in args.remedies.split(","):
        name, _, flags = item.partition("=")
        if flags:
            custom[name] = flags
        remedies.append(name)
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    length = f"{args.steps} steps" if args.steps else f"{args.epochs:g} epochs"
    print(f"sweep: {args.model}, {args.nodes} nodes, {length}, seeds {args.seeds}")
    dense, dense_curves = {}, {}
    for seed in seeds:
        r = run(f"{args.model}-dense-s{seed}", ["--sparsifier=dense"], args, seed) or {"failed": 1}
        dense[seed] = None if r.get("failed") else r["final_accuracy"]
        dense_curves[seed] = r.get("eval")
    rows = {}
    for sp in args.sparsifiers.split(","):
        for ctl in args.controllers.split(","):
            for density in (float(d) for d in args.densities.split(",")):
                for remedy in remedies:
                    key = (sp, ctl, density, remedy)
                    for seed in seeds:
                        label = f"{args.model}-{sp}-{ctl}-{density:g}-{remedy}-s{seed}"
                        flags = [f"--sparsifier={sp}", f"--controller={ctl}",
                                 f"--density={density:g}",
                                 *remedy_flags(remedy, density, custom)]
                        rec = run(label, flags, args, seed)
                        if rec is None:
                            continue
                        rows.setdefault(key, []).append(
                            {"seed": seed, "flags": flags, "record": rec, "dense": dense[seed]})
    dense_acc = [100 * a for a in dense.values() if a is not None]
    head = [f"Fashion-MNIST, {args.model} ({length}, {args.nodes} nodes x 1 process), seeds "
            f"{args.seeds}; dense: " + ", ".join(f"{a:.2f} %" for a in dense_acc), ""]
    md = head + table(rows) + ["", "Test accuracy (%) at each evaluation:", ""] + curves(rows)
    goals = targets(rows, args.equal_steps)
    if goals:
        md += ["", "Targets (the defaults: no flag beyond --density):", ""] + goals
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    summary = {"model": args.model, "length": length, "nodes": args.nodes, "dense": dense,
               "runs": [{"key": list(k), **{x: v for x, v in r.items() if x != "record"},
                         "accuracy": r["record"].get("final_accuracy"),
                         "diverged_at": r["record"].get("diverged_at"),
                         "achieved_density": achieved_density(r["record"])}
                        for k, runs in rows.items() for r in runs]}
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if rows:
        plot(rows, dense, dense_curves, head[0], os.path.join(args.out, "sweep.png"))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
