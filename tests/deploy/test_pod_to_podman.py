# SPDX-License-Identifier: Apache-2.0
"""tests/deploy/pod_to_podman.py, which image-test.sh runs the manifests'
pod with: what it makes of the rendered Job is what Kubernetes would run
(image, command, environment, volumes, user, security, limits), and a
field it cannot translate is refused rather than dropped."""
import copy
import glob
import os

import pytest

import deploy_lib as d
import pod_to_podman as p

K8S = os.path.join(d.ROOT, "deploy", "k8s")
TARGETS = [os.path.join(K8S, "base")] + sorted(glob.glob(os.path.join(K8S, "overlays", "*")))
SECRETS = {"microd-token": "/srv/token", "microd-tls": "/srv/tls"}


def _flag(args, name):
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def _env(args):
    return dict(e.split("=", 1) for e in _flag(args, "-e"))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: os.path.relpath(t, K8S))
def test_every_overlay_translates(target):
    docs = d.kustomize(target)
    out = p.plan(docs, 0, "10.1.2.20", SECRETS, "t")
    assert set(out) == {"image", "ports", "volumes", "pod", "sidecar", "trainer", "startup"}


def test_the_four_node_pod_as_kubernetes_would_run_it():
    docs = d.kustomize(os.path.join(K8S, "overlays", "four-nodes"))
    job = p.job_of(docs)
    spec = job["spec"]["template"]["spec"]
    (sidecar,), (trainer,) = spec["initContainers"], spec["containers"]
    out = p.plan(docs, 2, "10.1.2.22", SECRETS, "t")
    # Named and addressed as the headless Service's record for index 2.
    assert _flag(out["pod"], "--network-alias") == ["microd-train-2.microd-train"]
    assert _flag(out["pod"], "--ip") == ["10.1.2.22"]
    config = p.config_map(docs, "microd-config")
    assert config["MICROD_NODES"] == "4"
    for args, c in ((out["sidecar"], sidecar), (out["trainer"], trainer)):
        # The rendered image (registry name and tag), command and args.
        i = args.index(c["image"])
        assert _flag(args, "--entrypoint") == c["command"][:1]
        assert args[i + 1:] == c["command"][1:] + c.get("args", [])
        env = _env(args)
        for k, v in config.items():
            assert env[k] == v, k
        assert _flag(args, "--user") == ["10001:10001"]
        assert _flag(args, "--cap-drop") == ["ALL"]
        assert "no-new-privileges" in _flag(args, "--security-opt")
        assert _flag(args, "--memory") == [str(4 << 30)]
    env = _env(out["sidecar"])
    assert env["MICROD_NODE_RANK"] == "2"
    assert env["MICROD_NODE_NAME"] == "microd-train-2"
    assert env["MICROD_HOSTNAME"] == "10.1.2.22"
    assert _env(out["trainer"])["MICROD_LOCAL_RANK"] == "0"
    assert "--read-only" in out["sidecar"] and "--read-only" not in out["trainer"]
    # One socket volume and one memory /dev/shm shared by both containers;
    # the token only in the sidecar, read-only.
    mounts = {role: _flag(out[role], "-v") for role in ("sidecar", "trainer")}
    assert "t-microd-socket2:/run/microd" in mounts["sidecar"]
    assert "t-microd-socket2:/run/microd" in mounts["trainer"]
    assert "t-dshm2:/dev/shm" in mounts["sidecar"] and "t-dshm2:/dev/shm" in mounts["trainer"]
    assert "/srv/token:/etc/microd:ro" in mounts["sidecar"]
    assert not any(m.startswith("/srv/token") for m in mounts["trainer"])
    (dshm,) = [v for v in out["volumes"] if v[-1] == "t-dshm2"]
    assert "type=tmpfs" in dshm and "o=nr_blocks=524288,uid=10001,gid=10001" in dshm
    assert out["ports"] == ["coordinator 7470", "metrics 9464"]
    # The startup probe is the manifest's command, run in the sidecar.
    assert out["startup"] == ["exec", "t-microd2"] + sidecar["startupProbe"]["exec"]["command"]


def _base_docs():
    return d.kustomize(os.path.join(K8S, "base"))


@pytest.mark.parametrize("change, says", [
    (lambda s: s.update(hostNetwork=True), "hostNetwork"),
    (lambda s: s["initContainers"][0].update(lifecycle={}), "lifecycle"),
    (lambda s: s["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
    (lambda s: s["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}), "X"),
    (lambda s: s["containers"][0]["volumeMounts"].append({"name": "nope", "mountPath": "/x"}),
     "nope"),
    (lambda s: s["initContainers"][0].pop("restartPolicy"), "native sidecar"),
    (lambda s: s["initContainers"][0]["resources"]["limits"].update({"nvidia.com/gpu": 1}),
     "nvidia.com/gpu"),
])
def test_a_field_it_cannot_translate_is_refused(change, says):
    docs = copy.deepcopy(_base_docs())
    change(p.job_of(docs)["spec"]["template"]["spec"])
    with pytest.raises(p.Unsupported, match=says):
        p.plan(docs, 0, "10.1.2.20", SECRETS, "t")


def test_a_secret_without_a_directory_is_refused():
    with pytest.raises(p.Unsupported, match="microd-token"):
        p.plan(_base_docs(), 0, "10.1.2.20", {}, "t")
