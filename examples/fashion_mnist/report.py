# SPDX-License-Identifier: Apache-2.0
"""Side-by-side report of the demo's runs: a table on stdout, PNG plots and
a JSON summary.

    report.py RUN.json [RUN.json ...] --out results/"""
import argparse
import json
import os

import numpy as np


def summary(r):
    d = dict(r.get("daemon", {}))
    if r["label"] == "dense":
        d["dense"] = True
    samples = r.get("samples", [])
    density = [s["selected"] / s["count"] for s in samples if s.get("count")]
    dense_bytes = 4 * d.get("count", 0)
    return {
        "label": r["label"],
        "final_accuracy": r["final_accuracy"],
        "final_test_loss": r["final_test_loss"],
        "final_train_loss": float(np.mean(r["loss"][-50:])),
        "achieved_density": float(np.mean(density)) if density and not d.get("dense") else 1.0,
        "mean_cre": None if d.get("dense") else d.get("mean_cre"),
        "bytes_sent_per_node_per_step": d.get("bytes_sent_per_step"),
        "bytes_vs_dense": (dense_bytes / d["bytes_sent_per_step"]) if d.get("bytes_sent_per_step") else None,
        "seconds_per_step": float(np.median(r["step_seconds"])),
        "steps": r["steps"],
        "world_size": r["world_size"],
    }


def table(rows):
    cols = [("run", "label", "{}"), ("test acc", "final_accuracy", "{:.2%}"),
            ("test loss", "final_test_loss", "{:.4f}"), ("train loss", "final_train_loss", "{:.4f}"),
            ("density", "achieved_density", "{:.3%}"), ("mean CRE", "mean_cre", "{:.2%}"),
            ("bytes/node/step", "bytes_sent_per_node_per_step", "{:,.0f}"),
            ("bytes vs dense", "bytes_vs_dense", "{:.0f}x fewer"), ("s/step", "seconds_per_step", "{:.3f}")]
    cells = [[c[0] for c in cols]]
    for r in rows:
        cells.append([("-" if r[k] is None or (k == "bytes_vs_dense" and r["label"] == "dense")
                       else f.format(r[k])) for _, k, f in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plots(runs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps = [e["step"] for e in r["eval"]]
        a1.plot(steps, [100 * e["accuracy"] for e in r["eval"]], marker="o", label=r["label"])
        loss = np.array(r["loss"])
        k = 25
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        a2.plot(np.arange(k, len(loss) + 1), smooth, label=r["label"])
    a1.set(xlabel="step", ylabel="test accuracy (%)", title="Fashion-MNIST test accuracy")
    a2.set(xlabel="step", ylabel="training loss (rank 0, smoothed)", title="Training loss")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy_loss.png"), dpi=110)
    plt.close(fig)
    sparse = [r for r in runs if r.get("samples") and r["label"] != "dense"
              and not r.get("daemon", {}).get("dense")]
    if sparse:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in sparse:
            s = r["samples"]
            a1.plot([x["step"] for x in s], [100 * x["selected"] / x["count"] for x in s],
                    label=f"{r['label']} achieved")
            a1.axhline(100 * s[-1]["budget"] / s[-1]["count"], ls="--", color="gray",
                       label="target")
            a2.plot([x["step"] for x in s], [x["threshold"] for x in s], label=r["label"])
        a1.set(xlabel="step", ylabel="density (%)", title="Selected fraction per step")
        a2.set(xlabel="step", ylabel="threshold", title="Threshold per step", yscale="log")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "density_threshold.png"), dpi=110)
        plt.close(fig)


def gap_line(label, accuracy, dense_accuracy, within=1.0):
    """One line: how far a run's final test accuracy is from dense's, in
    words that agree with the sign, beside the target."""
    gap = 100 * (accuracy - dense_accuracy)
    if abs(gap) < 0.005:
        where = "the same accuracy as dense"
    else:
        where = f"{abs(gap):.2f} accuracy points {'below' if gap < 0 else 'above'} dense"
    verdict = "met" if gap >= -within else "MISSED"
    return f"{label}: {where} (target: at most {within:.1f} below) -> {verdict}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    runs = [json.load(open(p)) for p in args.runs]
    rows = [summary(r) for r in runs]
    os.makedirs(args.out, exist_ok=True)
    print(table(rows))
    by = {r["label"]: r for r in rows}
    result = {"runs": rows}
    if "dense" in by:
        for r in rows:
            if r["label"] != "dense":
                gap = 100 * (by["dense"]["final_accuracy"] - r["final_accuracy"])
                result.setdefault("accuracy_gap_points", {})[r["label"]] = gap
                print("\n" + gap_line(r["label"], r["final_accuracy"],
                                      by["dense"]["final_accuracy"]))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    plots(runs, args.out)
    print(f"\nplots: {args.out}/accuracy_loss.png, {args.out}/density_threshold.png; "
          f"summary: {args.out}/summary.json")


if __name__ == "__main__":
    main()
