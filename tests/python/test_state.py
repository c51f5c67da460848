# SPDX-License-Identifier: Apache-2.0
"""microd's compression state beside a PyTorch checkpoint: the demo's model
trained 3 steps, saved (model + microd.torch.save_state), every daemon and
process stopped, a new cluster loaded and 3 more steps: the parameters equal
6 steps straight, bit for bit."""
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "state_worker.py")
FLAGS = ["--momentum_correction=0.9", "--density=0.01"]


def params(path):
    with np.load(path) as z:
        return [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]


def run(cluster, out, first, steps, *extra):
    for code, text in cluster.run(WORKER, [out + "-{rank}.npz", str(first), str(steps), *extra]):
        assert code == 0, text


def test_a_saved_state_resumes_bit_for_bit(make_cluster, tmp_path):
    straight = make_cluster(2, 1, FLAGS)
    run(straight, str(tmp_path / "straight"), 0, 6)
    straight.stop()
    ckpt = str(tmp_path / "ckpt")
    first = make_cluster(2, 1, FLAGS)
    run(first, str(tmp_path / "first"), 0, 3, f"save={ckpt}")
    first.stop()
    assert sorted(os.listdir(ckpt)) == ["microd-state-node0.bin", "microd-state-node1.bin",
                                        "model-0.pt", "model-1.pt"]
    second = make_cluster(2, 1, FLAGS)
    run(second, str(tmp_path / "resumed"), 3, 3, f"load={ckpt}")
    for r in range(2):
        a = params(str(tmp_path / f"straight-{r}.npz"))
        b = params(str(tmp_path / f"resumed-{r}.npz"))
        assert len(a) == len(b) == 8
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


def test_loading_without_a_saved_state_is_refused(make_cluster, tmp_path):
    """A directory with the model but not microd's files: every process gets
    the error (not a silent fresh start)."""
    ckpt = str(tmp_path / "model-only")
    first = make_cluster(2, 1, FLAGS)
    run(first, str(tmp_path / "first"), 0, 2, f"save={ckpt}")
    first.stop()
    for r in range(2):
        os.remove(os.path.join(ckpt, f"microd-state-node{r}.bin"))
    second = make_cluster(2, 1, FLAGS)
    outs = second.run(WORKER, [str(tmp_path / "resumed") + "-{rank}.npz", "2", "2",
                               f"load={ckpt}"])
    assert all(code != 0 for code, _ in outs), outs
    assert all("no state file" in text for _, text in outs), outs
