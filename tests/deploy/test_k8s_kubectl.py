# SPDX-License-Identifier: Apache-2.0
"""The kustomize resolver of deploy_lib (which test_k8s.py checks the
manifests with) against the real `kubectl kustomize`, for the base and every
overlay. CTest registers this only where kubectl exists and passes its path
in KUBECTL; the generated Secret's values are not compared (a token file is
written for the overlays)."""
import glob
import os
import shutil
import subprocess

import pytest
import yaml

import deploy_lib as d

K8S = os.path.join(d.ROOT, "deploy", "k8s")
TARGETS = [os.path.join(K8S, "base")] + sorted(glob.glob(os.path.join(K8S, "overlays", "*")))


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: os.path.relpath(p, K8S))
def test_resolver_matches_kubectl_kustomize(target, tmp_path):
    shutil.copytree(K8S, tmp_path / "k8s")
    for overlay in glob.glob(str(tmp_path / "k8s" / "overlays" / "*")):
        open(os.path.join(overlay, "token"), "w").write("test-token\n")
    copy = tmp_path / "k8s" / os.path.relpath(target, K8S)
    out = subprocess.run([os.environ["KUBECTL"], "kustomize", str(copy)], check=True,
                         capture_output=True, text=True).stdout
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out)}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in d.kustomize(target)}
    for key in ("Secret",):
        for k in [k for k in theirs if k[0] == key]:
            theirs[k]["data"] = {n: "<generated>" for n in theirs[k]["data"]}
    assert ours == theirs


def _lost(ours, theirs, path=""):
    """Paths of `ours` that `theirs` lacks or holds another value at."""
    if isinstance(ours, dict):
        if not isinstance(theirs, dict):
            return [path or "/"]
        return [p for k, v in ours.items()
                for p in ([f"{path}.{k}"] if k not in theirs else _lost(v, theirs[k], f"{path}.{k}"))]
    if isinstance(ours, list):
        if not isinstance(theirs, list) or len(ours) != len(theirs):
            return [path]
        return [p for i, (a, b) in enumerate(zip(ours, theirs)) for p in _lost(a, b, f"{path}[{i}]")]
    return [] if ours == theirs or str(ours) == str(theirs) else [f"{path}: {ours!r} -> {theirs!r}"]


def _kubectl_local(args, obj):
    return subprocess.run([os.environ["KUBECTL"], *args, "--local", "-f", "-", "-o", "yaml"],
                          input=yaml.safe_dump(obj), capture_output=True, text=True)


def _round_trip(args, obj):
    out = _kubectl_local(args, obj)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# Offline schema validation: kubectl's client-side validation needs the
# API server's OpenAPI document, and no Debian package carries one for
# Kubernetes >= 1.29 (python3-kubernetes is 1.22, kubernetes-client 1.20).
# What kubectl 1.32 can do offline is decode an object into its own Go types
# (`set env --local` for a pod template, `set selector --local` for a
# Service): a value of the wrong type fails, and a field those types do not
# have is dropped, which the round trip shows. ConfigMap, Secret and
# NetworkPolicy have no such local command, and the PodMonitor and the
# cert-manager objects are custom resources without a schema here.
@pytest.mark.parametrize("target", TARGETS, ids=lambda p: os.path.relpath(p, K8S))
def test_job_and_service_decode_as_kubectl_types(target):
    for obj in d.kustomize(target):
        if obj["kind"] == "Job":
            back = _round_trip(["set", "env", "MICROD_ROUND_TRIP=1"], obj)
            spec = back["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                c["env"] = [e for e in c["env"] if e["name"] != "MICROD_ROUND_TRIP"]
                if not c["env"]:
                    del c["env"]
        elif obj["kind"] == "Service":
            selector = ",".join(f"{k}={v}" for k, v in obj["spec"]["selector"].items())
            back = _round_trip(["set", "selector", selector], obj)
        else:
            continue
        assert _lost(obj, back) == [], f"{obj['kind']}: fields kubectl 1.32's types do not keep"


def test_round_trip_catches_unknown_fields_and_wrong_types():
    (job,) = [o for o in d.kustomize(os.path.join(K8S, "base")) if o["kind"] == "Job"]
    job["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    back = _round_trip(["set", "env", "MICROD_ROUND_TRIP=1"], job)
    assert ".spec.template.spec.initContainers[0].restartPolicyy" in _lost(job, back)
    job["spec"]["template"]["spec"]["initContainers"][0]["ports"][0]["containerPort"] = "7470x"
    out = _kubectl_local(["set", "env", "X=1"], job)
    assert out.returncode != 0 and "containerPort" in out.stderr
