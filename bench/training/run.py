# SPDX-License-Identifier: Apache-2.0
"""Training-step comparison: the same model, data, seed and number of steps
through PyTorch DDP (Gloo allreduce, fp16 and PowerSGD hooks) and through
microd (its DDP hook, a local cluster of daemons), one method after another.

    /usr/bin/python3 bench/training/run.py --build build --out results/bench/training.json
    /usr/bin/python3 bench/training/run.py --smoke ...   # tiny model, a few steps

Every method runs --nodes processes on this machine's loopback, or with
--netlab-rate on an emulated network (deploy/netlab, root): every process and
its daemon in a network namespace of its own, links shaped to that rate.
--budget S runs each method for S seconds of training instead of --steps,
rank 0 recording the test accuracy against training time (time to accuracy).
Results per
method: median time per step after the warm-up steps, bytes written to
sockets per process per step (measured from /proc/PID/io: the trainer's for
DDP, its daemon's for microd), the loss on a fixed test subset after the last
step, and for microd the daemons' time split and per-step CRE history."""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON = "/usr/bin/python3"

# name, worker method, extra worker args, daemon args
METHODS = [
    ("no-communication", "local", [], []),
    ("ddp", "ddp", [], []),
    ("ddp-fp16", "fp16", [], []),
    ("ddp-powersgd-r1", "powersgd", ["--powersgd-rank", "1"], []),
    ("ddp-powersgd-r4", "powersgd", ["--powersgd-rank", "4"], []),
    ("microd-micro-1%", "microd", [], ["--sparsifier=micro", "--density=0.01"]),
    ("microd-micro-0.1%", "microd", [], ["--sparsifier=micro", "--density=0.001", "--remedies=off"]),
    ("microd-topk-1%", "microd", [], ["--sparsifier=topk", "--density=0.01"]),
    ("microd-hard-1%", "microd", [], ["--sparsifier=hard", "--density=0.01"]),
    ("microd-micro-1%-paper", "microd", [],
     ["--sparsifier=micro", "--density=0.01", "--controller=paper"]),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs, deadline):
    """Waits for every process; on the first failure or at the deadline kills
    the rest. Returns the first non-zero exit status (or 124 on timeout)."""
    status = 0
    while procs:
        for p in list(procs):
            code = p.poll()
            if code is None:
                continue
            procs.remove(p)
            if code != 0 and status == 0:
                status = code
                for q in procs:
                    os.killpg(q.pid, signal.SIGTERM)
        if procs and time.time() > deadline:
            status = status or 124
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
        time.sleep(0.1)
    return status


class Lab:
    """An emulated network of --nodes nodes (deploy/netlab), removed by close()."""

    def __init__(self, nodes, rate, delay):
        netlab = os.path.join(ROOT, "deploy", "netlab", "netlab.sh")
        def run(*a):
            r = subprocess.run([netlab, *a], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"netlab.sh {' '.join(a)}: {r.stderr.strip()}")
            return r.stdout.strip()
        self.run = run
        self.name = run("up", "--nodes", str(nodes), "--owner", str(os.getpid()), "--rate", rate,
                        "--delay", delay)
        self.addr = [run("addr", self.name, str(r)) for r in range(nodes)]
        self.ns = [run("ns", self.name, str(r)) for r in range(nodes)]

    def close(self):
        self.run("down", self.name)


def run_method(name, method, extra, daemon_args, args, env, lab=None):
    out_dir = os.path.join(args.work, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    worker = [PYTHON, os.path.join(HERE, "worker.py"), "--method", method, *extra,
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
              "--width", str(args.width), "--lr", str(args.lr), "--port", str(free_port()),
              "--out-dir", out_dir, "--microctl", os.path.join(args.build, "daemon", "microctl")]
    if args.budget > 0 and args.target_accuracy > 0:
        worker += ["--target-accuracy", str(args.target_accuracy)]
    if args.budget > 0:
        worker += ["--budget", str(args.budget), "--eval-every", str(args.eval_every),
                   "--eval-size", str(args.eval_size)]
    deadline = time.time() + args.timeout
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs)
    if method == "microd":
        dargs = [*daemon_args, f"--momentum_correction={args.momentum}"]
        if args.smoke:  # the tiny model is one small bucket: keep it on the sparse path
            dargs.append("--dense_floor=1024")
        cmd = [os.path.join(ROOT, "deploy", "local", "launch.sh"), "--nodes", str(args.nodes),
               "--local", "1", "--microd", os.path.join(args.build, "daemon", "microd"),
               "--logs", logs]
        if lab is not None:
            cmd += ["--netlab", lab.name]
        for a in dargs:
            cmd += ["--daemon-arg", a]
        procs = [subprocess.Popen(cmd + ["--", *worker], env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    else:
        dargs = []
        procs = []
        for r in range(args.nodes):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(args.nodes))
            cmd = worker
            if lab is not None:
                e.update(GLOO_SOCKET_IFNAME="eth0", MICROD_MASTER_ADDR=lab.addr[0])
                cmd = ["ip", "netns", "exec", lab.ns[r], *worker]
            with open(os.path.join(logs, f"rank{r}.log"), "w") as log:
                procs.append(subprocess.Popen(cmd, env=e, start_new_session=True,
                                              stdout=log, stderr=subprocess.STDOUT))
    t0 = time.time()
    code = wait_all(procs, deadline)
    result = {"name": name, "method": method, "daemon_args": dargs, "exit_status": code,
              "wall_seconds": time.time() - t0, "logs": logs}
    ranks = []
    for r in range(args.nodes):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if code != 0 or len(ranks) != args.nodes:
        result["error"] = (f"exit status {code}, {len(ranks)} of {args.nodes} ranks reported "
                           f"(logs: {logs})")
        return result
    result.update(summarize(ranks, args.warmup))
    return result


def summarize(ranks, warmup):
    """Figures of one method from the per-rank records."""
    r0 = next(r for r in ranks if r["rank"] == 0)
    timed = r0["step_seconds"][warmup:]
    bytes_key = "daemon_socket_bytes_per_step" if "daemon_socket_bytes_per_step" in r0 \
        else "socket_bytes_per_step"
    out = {
        "parameters": r0["parameters"],
        "steps": len(r0["step_seconds"]),
        "step_ms": 1000 * statistics.median(timed) if timed else None,
        "step_ms_per_rank": [1000 * statistics.median(r["step_seconds"][warmup:]) for r in ranks
                             if r["step_seconds"][warmup:]],
        "bytes_per_process_per_step": statistics.mean(r[bytes_key] for r in ranks),
        "test_loss": r0.get("test_loss"),
        "train_loss_last10": statistics.mean(r0["loss"][-10:]),
        "loss": r0["loss"],
        "diverged_at": r0.get("diverged_at"),
    }
    if "curve" in r0:
        out["curve"] = r0["curve"]
    if "reached" in r0:
        out["reached"] = r0["reached"]
    buckets = r0.get("daemon_buckets")
    if buckets is not None:
        steps = max(1, out["steps"])
        sparse = [b for b in buckets if not b.get("dense") and int(b.get("steps", 0)) > 0]
        out["daemon"] = {
            "payload_bytes_sent_per_step": sum(int(b.get("bytesSent", 0)) for b in buckets) / steps,
            # (a daemon without the waiting figure reports no "negotiateSeconds")
            "seconds_per_step": {k: sum(float(b.get(k + "Seconds", 0)) for b in buckets) / steps
                                 for k in ("negotiate", "localSum", "select", "exchange", "writeback")
                                 if k != "negotiate" or any(k + "Seconds" in b for b in buckets)},
            "mean_cre": [float(b.get("meanCre", 0)) for b in sparse],
            "history": {b["name"]: [[int(h.get("step", 0)), float(h.get("cre", 0)),
                                     int(h.get("selected", 0)), int(h.get("budget", 0))]
                                    for h in b.get("history", [])] for b in sparse},
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "training.json"))
    ap.add_argument("--work", default="", help="per-run files (default: next to --out)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="per process")
    ap.add_argument("--width", type=int, default=4096, help="MLP width (4096: 25.3 M parameters)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9,
                    help="SGD momentum (DDP) = the daemons' momentum correction (microd)")
    ap.add_argument("--methods", default="", help="comma-separated subset of: " +
                    ", ".join(m[0] for m in METHODS).replace("%", "%%"))
    ap.add_argument("--update", action="store_true",
                    help="keep the other methods' results already in --out")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per method")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 2 processes, 4 steps: checks the pipeline, not the figures")
    ap.add_argument("--netlab-rate", default="",
                    help="on an emulated network with links at this rate (100mbit, 1gbit; root)")
    ap.add_argument("--netlab-delay", default="0.05ms", help="one-way delay per link ingress")
    ap.add_argument("--budget", type=float, default=0,
                    help="time to accuracy: seconds of training per method instead of --steps")
    ap.add_argument("--eval-every", type=float, default=15,
                    help="with --budget: seconds of training between test-accuracy evaluations")
    ap.add_argument("--target-accuracy", type=float, default=0,
                    help="with --budget: each method trains until its test accuracy reaches "
                         "this (time to accuracy; the budget bounds it)")
    ap.add_argument("--eval-size", type=int, default=1000,
                    help="with --budget: test images per evaluation (the same ones every time)")
    args = ap.parse_args()
    if args.smoke:
        args.nodes, args.steps, args.warmup, args.width, args.batch = 2, 4, 1, 64, 8
        args.timeout = min(args.timeout, 180)
    args.build = os.path.abspath(args.build)
    # Per-run files beside --out, in a folder named after it (training.json ->
    # training/), so that runs written to other files keep their own.
    args.work = args.work or os.path.splitext(os.path.abspath(args.out))[0]
    chosen = [m for m in METHODS if not args.methods or m[0] in args.methods.split(",")]
    unknown = set(filter(None, args.methods.split(","))) - {m[0] for m in METHODS}
    if unknown:
        sys.exit(f"run.py: unknown method(s) {', '.join(sorted(unknown))}")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"),
               MICROD_LIBRARY=os.path.join(args.build, "client", "libmicrod.so"),
               OMP_NUM_THREADS="1")
    results = []
    lab = None
    if args.netlab_rate:
        env["NETLAB_DELAY_BIN"] = os.path.join(args.build, "deploy", "netlab", "microd-netlab-delay")
        lab = Lab(args.nodes, args.netlab_rate, args.netlab_delay)
        print(f"  on an emulated network: {args.nodes} nodes, links at {args.netlab_rate}, "
              f"{args.netlab_delay} each way (lab {lab.name})", flush=True)
    try:
        for name, method, extra, dargs in chosen:
            print(f"  {name:<24}", end="", flush=True)
            r = run_method(name, method, extra, dargs, args, env, lab)
            results.append(r)
            if "error" in r:
                print(f"FAILED: {r['error']}")
            elif "curve" in r:
                last = r["curve"][-1] if r["curve"] else [0, 0, 0]
                reached = (f"; {100 * args.target_accuracy:.0f} % after {r['reached'][1]} steps, "
                           f"{r['reached'][0]:.0f} s" if "reached" in r else "")
                print(f"{r['step_ms']:9.1f} ms/step  {last[1]} steps in {last[0]:.0f} s: test "
                      f"accuracy {100 * last[2]:.1f} %{reached}  ({r['wall_seconds']:.0f} s)")
            else:
                print(f"{r['step_ms']:9.1f} ms/step {r['bytes_per_process_per_step'] / 1e6:10.3f} "
                      f"MB/step  test loss {r['test_loss']:.4f}  ({r['wall_seconds']:.0f} s)")
    finally:
        if lab is not None:
            lab.close()
    config = {k: getattr(args, k) for k in ("nodes", "steps", "warmup", "batch", "width", "lr",
                                            "momentum", "smoke", "netlab_rate", "netlab_delay",
                                            "budget", "eval_every", "eval_size",
                                            "target_accuracy")}
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old.get("config") != config:
            sys.exit("run.py --update: the existing results used another configuration")
        done = {r["name"] for r in results}
        order = [m[0] for m in METHODS]
        results = sorted([r for r in old["methods"] if r["name"] not in done] + results,
                         key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": config, "methods": results}, f)
    print(f"  written {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
