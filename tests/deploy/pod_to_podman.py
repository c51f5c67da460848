# SPDX-License-Identifier: Apache-2.0
"""The pod the Kubernetes manifests describe, as podman commands.

image-test.sh runs a job from what `kustomize` renders for an overlay, one
podman pod per node, instead of a wiring of its own: the same image, command
and arguments, environment (the ConfigMap, and the values Kubernetes fills
in for the Downward API fields), volumes at the same paths, user, group,
capabilities, read-only root, limits and the sidecar's startup probe, with
the native sidecar's order kept by hand (the trainer starts once the
sidecar's startup probe passes). Every field of the pod spec it meets is
either translated or refused: a change to the manifests that podman would
not run the same way fails here, not silently.

    pod_to_podman.py --k8s DIR --overlay NAME --node R --pod-ip IP
        --secret NAME=HOSTDIR ... --prefix P --part pod|sidecar|trainer|startup

prints the shell-quoted commands of that part (the podman arguments after
`podman`; `volumes`: one per line), or with `--part nodes` the job's node
count.
"""
import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib  # noqa: E402

# What Kubernetes itself sets: handled, or checked to need nothing here.
POD_SPEC = {"restartPolicy", "subdomain", "securityContext", "initContainers", "containers",
            "volumes"}
POD_SECURITY = {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"}
CONTAINER = {"name", "image", "command", "args", "env", "envFrom", "ports", "resources",
             "securityContext", "volumeMounts", "restartPolicy", "startupProbe",
             "readinessProbe", "livenessProbe"}
CONTAINER_SECURITY = {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"}
VOLUME_MOUNT = {"name", "mountPath", "readOnly"}


class Unsupported(ValueError):
    """A field of the manifests this translation does not know."""


def _only(obj, allowed, where):
    unknown = set(obj) - allowed
    if unknown:
        raise Unsupported(f"{where}: no podman translation for {sorted(unknown)}")


def job_of(docs):
    (job,) = [d for d in docs if d["kind"] == "Job"]
    return job


def config_map(docs, name):
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    return cm.get("data", {})


def _quantity_bytes(q):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, mult in units.items():
        if str(q).endswith(suffix):
            return int(str(q)[:-2]) * mult
    return int(q)


def _cpus(q):
    q = str(q)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def container_env(docs, c, pod):
    """The container's environment as Kubernetes builds it: envFrom first,
    then env (which wins); Downward API fields from `pod`."""
    env = {}
    for src in c.get("envFrom", []):
        _only(src, {"configMapRef"}, f"{c['name']}.envFrom")
        env.update(config_map(docs, src["configMapRef"]["name"]))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if ref is None or ref not in pod["fields"]:
            raise Unsupported(f"{c['name']}.env {e['name']}: no value for {e.get('valueFrom')}")
        env[e["name"]] = pod["fields"][ref]
    return env


def plan(docs, node, pod_ip, secrets, prefix):
    """podman arguments for node `node`'s pod: {"pod", "sidecar", "trainer",
    "startup"} (lists of arguments after `podman`)."""
    job = job_of(docs)
    name = job["metadata"]["name"]
    spec = job["spec"]["template"]["spec"]
    _only(spec, POD_SPEC, "pod spec")
    if spec.get("restartPolicy") != "Never":
        raise Unsupported("pod restartPolicy other than Never")
    sec = spec.get("securityContext", {})
    _only(sec, POD_SECURITY, "pod securityContext")
    if sec.get("seccompProfile", {}).get("type", "RuntimeDefault") != "RuntimeDefault":
        raise Unsupported("a seccomp profile other than RuntimeDefault")
    pod_name = f"{name}-{node}"
    pod = {"name": pod_name, "fields": {
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(node),
        "metadata.name": pod_name,
        "status.podIP": pod_ip,
    }}
    # The pod: its own address on the network, named as the headless
    # Service's DNS record <pod>.<subdomain> for <job>-<index>.
    out = {"pod": ["pod", "create", "--name", f"{prefix}-pod{node}", "--ip", pod_ip,
                   "--network-alias", f"{pod_name}.{spec['subdomain']}",
                   "--hostname", pod_name]}
    # Volumes: emptyDir -> a podman volume of this pod; medium Memory -> a
    # tmpfs; secret -> the caller's directory, read-only.
    volumes = {}
    out["volumes"] = []
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if kinds == {"emptyDir"}:
            # One volume the pod's containers share, as an emptyDir is.
            ed = v["emptyDir"] or {}
            _only(ed, {"medium", "sizeLimit"}, f"volume {v['name']}")
            vol = f"{prefix}-{v['name']}{node}"
            create = ["volume", "create"]
            if ed.get("medium") == "Memory":
                size = _quantity_bytes(ed.get("sizeLimit", "64Mi"))
                # In pages: podman 4.3 takes a "size" option for a quota.
                create += ["--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt",
                           f"o=nr_blocks={-(-size // 4096)},uid={sec['runAsUser']},"
                           f"gid={sec['fsGroup']}"]
            out["volumes"].append(create + [vol])
            volumes[v["name"]] = lambda path, ro, vol=vol: [
                "-v", f"{vol}:{path}" + (":ro" if ro else "")]
        elif kinds == {"secret"}:
            _only(v["secret"], {"secretName", "defaultMode"}, f"volume {v['name']}")
            host = secrets.get(v["secret"]["secretName"])
            if host is None:
                raise Unsupported(f"no directory given for secret {v['secret']['secretName']}")
            volumes[v["name"]] = lambda path, ro, host=host: ["-v", f"{host}:{path}:ro"]
        else:
            raise Unsupported(f"volume {v['name']}: {sorted(kinds)}")

    def container_args(c, role):
        _only(c, CONTAINER, f"container {c['name']}")
        args = ["run", "-d", "--pod", f"{prefix}-pod{node}", "--name", f"{prefix}-{role}{node}",
                "--health-interval=disable",
                "--user", f"{sec['runAsUser']}:{sec['runAsGroup']}",
                "--group-add", str(sec.get("fsGroup", sec["runAsGroup"]))]
        csec = c.get("securityContext", {})
        _only(csec, CONTAINER_SECURITY, f"container {c['name']} securityContext")
        _only(csec.get("capabilities", {}), {"drop", "add"}, f"container {c['name']} capabilities")
        for cap in csec.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        for cap in csec.get("capabilities", {}).get("add", []):
            args += ["--cap-add", cap]
        if csec.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if csec.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        limits = c.get("resources", {}).get("limits", {})
        _only(limits, {"cpu", "memory"}, f"container {c['name']} limits")
        if "cpu" in limits:
            args += ["--cpus", str(_cpus(limits["cpu"]))]
        if "memory" in limits:
            args += ["--memory", str(_quantity_bytes(limits["memory"]))]
        for key, value in sorted(container_env(docs, c, pod).items()):
            args += ["-e", f"{key}={value}"]
        for m in c.get("volumeMounts", []):
            _only(m, VOLUME_MOUNT, f"container {c['name']} volumeMount")
            if m["name"] not in volumes:
                raise Unsupported(f"container {c['name']} mounts unknown volume {m['name']}")
            args += volumes[m["name"]](m["mountPath"], m.get("readOnly", False))
        command = c.get("command")
        if command:
            args += ["--entrypoint", command[0]]
        args.append(c["image"])
        args += (command[1:] if command else []) + c.get("args", [])
        return args

    inits = spec.get("initContainers", [])
    sidecars = [c for c in inits if c.get("restartPolicy") == "Always"]
    if len(sidecars) != 1 or len(inits) != 1 or len(spec["containers"]) != 1:
        raise Unsupported("a pod other than one native sidecar and one container")
    (sidecar,), (trainer,) = sidecars, spec["containers"]
    out["sidecar"] = container_args(sidecar, "microd")
    out["trainer"] = container_args(trainer, "trainer")
    probe = sidecar.get("startupProbe", {})
    _only(probe, {"exec", "periodSeconds", "timeoutSeconds", "failureThreshold"}, "startupProbe")
    out["startup"] = ["exec", f"{prefix}-microd{node}"] + probe["exec"]["command"]
    out["image"] = sorted({sidecar["image"], trainer["image"]})
    # The ports the sidecar declares (not published: a pod's address is
    # reached directly, on Kubernetes as on the podman network).
    out["ports"] = [f"{port['name']} {port['containerPort']}" for port in sidecar.get("ports", [])]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k8s", required=True, help="a copy of deploy/k8s (with the token files)")
    ap.add_argument("--overlay", required=True)
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--pod-ip", required=True)
    ap.add_argument("--secret", action="append", default=[], help="NAME=HOSTDIR")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--part", choices=["image", "ports", "volumes", "pod", "sidecar", "trainer", "startup", "nodes"],
                    required=True)
    a = ap.parse_args()
    docs = deploy_lib.kustomize(os.path.join(a.k8s, "overlays", a.overlay))
    if a.part == "nodes":
        print(job_of(docs)["spec"]["completions"])
        return
    secrets = dict(s.split("=", 1) for s in a.secret)
    part = plan(docs, a.node, a.pod_ip, secrets, a.prefix)[a.part]
    if a.part in ("image", "ports"):
        print("\n".join(part))
        return
    for command in part if a.part == "volumes" else [part]:
        print(shlex.join(command))


if __name__ == "__main__":
    main()
