# SPDX-License-Identifier: Apache-2.0
"""Training stability at 0.1 % density: the Fashion-MNIST CNN on 4 nodes,
exact-density controller, SGD momentum 0.9. Without remedies
(--remedies=off) it diverges and every process gets a clear NaN/Inf error
(no hang); with the daemon's defaults (what `make demo DEMO_ARGS="--density
0.001"` runs) or with momentum correction and a warm-up chosen by hand it
trains."""
import json
import os
import tempfile

import numpy as np

from conftest import BUILD, ROOT

TRAIN = os.path.join(ROOT, "examples", "fashion_mnist", "train.py")
ARGS = ["--epochs", "0.33", "--evals", "1", "--lr", "0.05", "--momentum", "0.9"]


def run(cluster, out):
    os.environ["MICROCTL"] = os.path.join(BUILD, "daemon", "microctl")
    return cluster.run(TRAIN, [*ARGS, "--label", "run", "--out", out], timeout=400)


def assert_trains(cluster):
    """Every process finishes, and the loss stays finite and falls."""
    out = os.path.join(tempfile.mkdtemp(), "r.json")
    results = run(cluster, out)
    for code, text in results:
        assert code == 0, text[-2000:]
    losses = np.array(json.load(open(out))["loss"])
    assert np.all(np.isfinite(losses))
    assert losses[-20:].mean() < 0.6 * losses[:20].mean(), (losses[:20].mean(), losses[-20:].mean())


def test_diverges_without_remedies_with_a_clear_error(make_cluster):
    cluster = make_cluster(4, 1, ["--density=0.001", "--remedies=off"])
    results = run(cluster, os.path.join(tempfile.mkdtemp(), "r.json"))
    for code, text in results:
        assert code != 0, "expected the run to fail"
        assert "NaN or Inf in the gradient" in text, text[-2000:]
        assert "grads.0" in text


def test_trains_at_0_1_percent_with_the_defaults(make_cluster):
    # The demo's flags: only the density and its momentum correction. Without
    # the defaults this diverged at step 139 (NaN/Inf on every node).
    cluster = make_cluster(4, 1, ["--density=0.001", "--momentum_correction=0.9"])
    assert_trains(cluster)
    # The CNN's one bucket (147,146 values, k = 147 at 0.1 %) gets the floor
    # on k, and the daemon says what it applied: no warm-up by default.
    log = cluster.daemon_log(0)
    assert "remedy at density 0.001: warm-up" not in log, log[-2000:]
    assert "remedy at density 0.001: minimum k" in log, log[-2000:]
    assert "bucket 'grads.0' (147146 values): k = 147 at density 0.001 is below --min_k = 2000" \
        " (too few to train on); it steps at density 0.0136 (k = 2000)" in log, log[-2000:]


def test_trains_with_momentum_correction_and_warmup(make_cluster):
    cluster = make_cluster(4, 1, ["--density=0.001", "--momentum_correction=0.9",
                                  "--warmup_steps=50", "--warmup_density=0.1",
                                  "--warmup_decay_steps=200"])
    assert_trains(cluster)
