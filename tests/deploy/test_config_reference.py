# SPDX-License-Identifier: Apache-2.0
"""deploy/README.md's configuration reference lists every flag of microd
(read from daemon/flags.cc) with its MICROD_* variable and its default,
and nothing that is not a flag; and microd really reads each variable."""
import os
import re
import subprocess

import pytest

import deploy_lib as d

README = os.path.join(d.ROOT, "deploy", "README.md")
FLAGS = d.microd_flags()
ROWS = {}
for line in open(README):
    m = re.match(r"\| `--(\w+)` \| `(MICROD_\w+)` \| (`[^`]*`|\(empty\)) \| (.+) \|$", line.strip())
    if m:
        ROWS[m.group(1)] = (m.group(2), m.group(3).strip("`"), m.group(4))


def test_every_flag_is_documented():
    missing = sorted(set(FLAGS) - set(ROWS))
    assert not missing, f"deploy/README.md lacks {missing}"


def test_documented_flags_exist():
    extra = sorted(set(ROWS) - set(FLAGS))
    assert not extra, f"deploy/README.md documents flags microd lacks: {extra}"


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_variable_and_default(name):
    env, default, meaning = ROWS[name]
    assert env == "MICROD_" + name.upper()
    assert d.same_default(default, FLAGS[name]["default"]), (name, default, FLAGS[name]["default"])
    assert len(meaning) > 5


def test_microd_reads_every_variable():
    """Each MICROD_<FLAG> reaches the flag parser: a value the flag's type
    cannot take is refused naming the variable (string flags are checked by
    the options that validate them: sparsifier, controller, nonfinite)."""
    microd = os.path.join(os.environ["MICROD_BUILD_DIR"], "daemon", "microd")
    bad = {"int": "x", "double": "x", "uint64_t": "-x", "bool": "x"}
    for name, flag in FLAGS.items():
        var = "MICROD_" + name.upper()
        if flag["type"] in bad:
            value = bad[flag["type"]]
        elif name in ("sparsifier", "controller", "nonfinite", "transport", "log_level",
                      "log_format"):
            value = "no-such-value"
        else:
            continue
        r = subprocess.run([microd], env={**os.environ, var: value}, capture_output=True,
                           text=True, timeout=20)
        assert r.returncode != 0, f"microd accepted {var}={value}"
        assert var in r.stderr or name in r.stderr, (var, r.stderr)


@pytest.mark.parametrize("var,value", [("MICROD_GLOO_IO_NICE", "20"), ("MICROD_GLOO_IO_NICE", "-1"),
                                       ("MICROD_LOCAL_SIZE", "0"), ("MICROD_DENSITY", "0")])
def test_microd_refuses_values_out_of_range(var, value):
    """A value of the right type but out of range stops microd at start with
    the flag's name, before it joins anything."""
    microd = os.path.join(os.environ["MICROD_BUILD_DIR"], "daemon", "microd")
    r = subprocess.run([microd], env={**os.environ, var: value}, capture_output=True, text=True,
                       timeout=20)
    assert r.returncode != 0, f"microd accepted {var}={value}"
    flag = var[len("MICROD_"):].lower()
    assert flag in r.stderr, (var, r.stderr)


def test_nccl_without_a_gpu_stops_before_joining():
    """--transport=nccl on a machine without a usable GPU (or in a build
    without NCCL) stops at once with the reason, instead of joining a job it
    cannot serve."""
    import shutil
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"],
                                                     capture_output=True).returncode == 0:
        pytest.skip("a GPU is visible here: the GPU path is checked by scripts/gpu-check.sh")
    microd = os.path.join(os.environ["MICROD_BUILD_DIR"], "daemon", "microd")
    r = subprocess.run([microd, "--transport=nccl", "--nodes=2", "--coordinator_listen=127.0.0.1:0",
                        "--admin=127.0.0.1:0", "--join_timeout_ms=60000",
                        f"--socket=/tmp/microd-nccl-test-{os.getpid()}/s.sock"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "no usable GPU" in r.stderr or "not available in this build" in r.stderr, r.stderr
    assert "is rank" not in r.stderr, "it joined the job"
