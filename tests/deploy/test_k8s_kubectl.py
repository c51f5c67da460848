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
