# SPDX-License-Identifier: Apache-2.0
"""The Kubernetes manifests (deploy/k8s), rendered with the resolver in
deploy_lib (base and every overlay): the sidecar and the trainer are wired
together consistently — socket path and volume, ports of the coordinator in
the ConfigMap, the container and the headless Service, probes on the Admin
port's health service, the token Secret and its key, ConfigMap keys, and
every MICROD_* variable the daemon reads is one of microd's flags.
test_k8s_kubectl.py compares the resolver with `kubectl kustomize`."""
import glob
import os
import re

import pytest
import yaml

import deploy_lib as d

K8S = os.path.join(d.ROOT, "deploy", "k8s")
TARGETS = [os.path.join(K8S, "base")] + sorted(glob.glob(os.path.join(K8S, "overlays", "*")))
FLAGS = d.microd_flags()
# Variables the client side reads (client/src/microd.c, client/python, microctl).
CLIENT_VARS = {"MICROD_SOCKET", "MICROD_LOCAL_RANK", "MICROD_LIBRARY", "MICROD_PREFIX",
               "MICROD_ADMIN"}


def _one(objs, kind):
    (o,) = [x for x in objs if x["kind"] == kind]
    return o


def _named(objs, kind, name):
    found = [x for x in objs if x["kind"] == kind and x["metadata"]["name"] == name]
    assert found, f"no {kind} named {name}"
    return found[0]


def _env(objs, container):
    """The container's environment as {name: value or ('fieldRef', path)}."""
    env = {}
    for src in container.get("envFrom", []):
        cm = _named(objs, "ConfigMap", src["configMapRef"]["name"])
        env.update(cm["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["configMapKeyRef"]
            cm = _named(objs, "ConfigMap", ref["name"])
            assert ref["key"] in cm["data"], f"ConfigMap {ref['name']} has no key {ref['key']}"
            env[e["name"]] = cm["data"][ref["key"]]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = ("fieldRef", e["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            raise AssertionError(f"unhandled env source {e}")
    return env


def _volume_at(pod, container, path):
    """The pod volume mounted at `path` in `container`."""
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert mounts, f"{container['name']}: nothing mounted at {path}"
    (vol,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return vol


@pytest.fixture(params=TARGETS, ids=lambda p: os.path.relpath(p, K8S))
def rendered(request):
    objs = d.kustomize(request.param)
    job = _one(objs, "Job")
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    return objs, job, pod, sidecar, trainer


def test_yaml_parses_and_every_file_is_used():
    files = sorted(glob.glob(os.path.join(K8S, "**", "*.yaml"), recursive=True))
    used = set()
    for t in TARGETS:
        k = yaml.safe_load(open(os.path.join(t, "kustomization.yaml")))
        used.add(os.path.join(t, "kustomization.yaml"))
        used |= {os.path.normpath(os.path.join(t, r)) for r in k.get("resources", [])}
        used |= {os.path.normpath(os.path.join(t, p["path"])) for p in k.get("patches", [])}
    for f in files:
        assert list(yaml.safe_load_all(open(f))), f"{f} is empty"
        assert f in used, f"{f} is not part of any kustomization"


def test_native_sidecar_and_indexed_job(rendered):
    objs, job, pod, sidecar, trainer = rendered
    assert sidecar["restartPolicy"] == "Always"
    assert job["spec"]["completionMode"] == "Indexed"
    nodes = int(_env(objs, sidecar)["MICROD_NODES"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    env = _env(objs, sidecar)
    assert env["MICROD_NODE_RANK"] == (
        "fieldRef", "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert env["MICROD_HOSTNAME"] == ("fieldRef", "status.podIP")
    assert "exec microd" in " ".join(sidecar["args"])


def test_overlay_is_a_four_node_job():
    objs = d.kustomize(os.path.join(K8S, "overlays", "four-nodes"))
    assert _one(objs, "Job")["spec"]["completions"] == 4
    assert _named(objs, "ConfigMap", "microd-config")["data"]["MICROD_NODES"] == "4"


def test_socket_shared_through_an_emptydir(rendered):
    objs, job, pod, sidecar, trainer = rendered
    sock = _env(objs, sidecar)["MICROD_SOCKET"]
    assert _env(objs, trainer)["MICROD_SOCKET"] == sock
    a = _volume_at(pod, sidecar, os.path.dirname(sock))
    b = _volume_at(pod, trainer, os.path.dirname(sock))
    assert a["name"] == b["name"] and "emptyDir" in a


def test_dev_shm_is_memory_backed(rendered):
    objs, job, pod, sidecar, trainer = rendered
    for c in (sidecar, trainer):
        assert _volume_at(pod, c, "/dev/shm")["emptyDir"]["medium"] == "Memory"


def test_token_from_a_secret_volume(rendered):
    objs, job, pod, sidecar, trainer = rendered
    path = _env(objs, sidecar)["MICROD_TOKEN_FILE"]
    vol = _volume_at(pod, sidecar, os.path.dirname(path))
    assert vol["secret"]["secretName"] and vol["secret"]["defaultMode"] & 0o077 == 0
    (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"] is True
    # Only the daemon sees the token.
    assert vol["name"] not in [m["name"] for m in trainer.get("volumeMounts", [])]


def test_overlays_create_the_token_secret():
    for t in TARGETS[1:]:
        objs = d.kustomize(t)
        pod = _one(objs, "Job")["spec"]["template"]["spec"]
        path = _env(objs, pod["initContainers"][0])["MICROD_TOKEN_FILE"]
        vol = _volume_at(pod, pod["initContainers"][0], os.path.dirname(path))
        secret = _named(objs, "Secret", vol["secret"]["secretName"])
        assert os.path.basename(path) in secret["data"]


def test_coordinator_reached_through_the_headless_service(rendered):
    objs, job, pod, sidecar, trainer = rendered
    svc = _named(objs, "Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    if any(o["kind"] == "Deployment" for o in objs):
        return  # a coordinator of its own (test_elastic_overlay_...)
    host, port = _env(objs, sidecar)["MICROD_COORDINATOR"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == "coordinator"]
    (cp,) = [p for p in sidecar["ports"] if p["name"] == "coordinator"]
    assert int(port) == sp["port"] == cp["containerPort"]
    assert sp["targetPort"] in (cp["name"], cp["containerPort"])
    # Node 0 serves the coordinator on the port of the address the others dial.
    assert 'MICROD_COORDINATOR_LISTEN="0.0.0.0:${MICROD_COORDINATOR##*:}"' in sidecar["args"][0]


def test_admin_port_probes_and_not_exposed(rendered):
    objs, job, pod, sidecar, trainer = rendered
    admin = _env(objs, sidecar)["MICROD_ADMIN"]
    # A Unix socket: no port anyone else in the pod (or outside it) reaches.
    assert admin.startswith("unix:/"), "the Admin service must stay on a Unix socket"
    mounts = [m["mountPath"] for m in sidecar.get("volumeMounts", [])]
    assert any(admin[len("unix:"):].startswith(m.rstrip("/") + "/") for m in mounts), \
        "the Admin socket must be in a volume of the sidecar's"
    service = d.health_service_name()
    for probe, want_service in (("startupProbe", service), ("readinessProbe", service),
                                ("livenessProbe", None)):
        cmd = sidecar[probe]["exec"]["command"]
        assert cmd[0] == "microd-health"
        assert f"--admin={admin}" in cmd
        got = [a.split("=", 1)[1] for a in cmd if a.startswith("--service=")]
        assert got == ([want_service] if want_service else []), (probe, cmd)
        timeout = [int(a.split("=")[1]) for a in cmd if a.startswith("--timeout_ms=")]
        assert timeout and timeout[0] < 1000 * sidecar[probe].get("timeoutSeconds", 1)
    # The startup probe waits as long as the daemon waits for the other nodes.
    sp = sidecar["startupProbe"]
    join_ms = int(_env(objs, sidecar).get("MICROD_JOIN_TIMEOUT_MS",
                                          FLAGS["join_timeout_ms"]["default"]))
    assert sp["periodSeconds"] * sp["failureThreshold"] * 1000 >= join_ms


def test_resources_and_security(rendered):
    objs, job, pod, sidecar, trainer = rendered
    for c in (sidecar, trainer):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0


def test_microd_variables_are_real_flags(rendered):
    objs, job, pod, sidecar, trainer = rendered
    flags = {"MICROD_" + f.upper() for f in FLAGS}
    for name in _env(objs, sidecar):
        assert name in flags, f"{name} is not a flag of microd"
    for name in re.findall(r"MICROD_[A-Z_]+", " ".join(sidecar["args"])):
        assert name in flags, f"{name} (sidecar script) is not a flag of microd"
    for name in _env(objs, trainer):
        assert name in flags | CLIENT_VARS, f"{name} is read by nobody"
    for name, value in _env(objs, sidecar).items():
        flag = FLAGS[name[len("MICROD_"):].lower()]
        if isinstance(value, str) and flag["type"] in ("int", "uint64_t"):
            assert re.fullmatch(r"-?\d+", value), f"{name}={value} is not an integer"
        if isinstance(value, str) and flag["type"] == "double":
            float(value)


def test_network_policy_admits_only_the_jobs_pods(rendered):
    """Only pods of the job reach its pods, on TCP: the coordinator port and
    Gloo's ephemeral ports (no port given: all of them); nothing else."""
    objs, job, pod, sidecar, trainer = rendered
    np = _named(objs, "NetworkPolicy", job["metadata"]["name"])
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in np["spec"]["policyTypes"]
    job_rule, metrics_rule = np["spec"]["ingress"]
    (peer,) = job_rule["from"]
    assert set(peer) == {"podSelector"}, "no namespaceSelector or ipBlock: this job's pods only"
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    assert job_rule["ports"] == [{"protocol": "TCP"}]
    assert all(p.get("protocol", "TCP") == "TCP" for p in sidecar.get("ports", []))
    # The monitoring namespace (Prometheus) reaches the metrics port, and
    # only it (before: every namespace, an empty selector).
    (peer,) = metrics_rule["from"]
    assert peer == {"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}, peer
    (port,) = metrics_rule["ports"]
    names = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert port["port"] == "metrics" and "metrics" in names


def test_metrics_port_annotations_and_flag_agree(rendered):
    objs, job, pod, sidecar, trainer = rendered
    metrics = _env(objs, sidecar)["MICROD_METRICS"]
    port = int(metrics.rsplit(":", 1)[1])
    (cp,) = [p for p in sidecar["ports"] if p["name"] == "metrics"]
    assert cp["containerPort"] == port
    ann = job["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == port
    assert ann["prometheus.io/path"] == "/metrics"
    # The Service lists the coordinator only.
    svc = _named(objs, "Service", pod["subdomain"])
    assert port not in [p["port"] for p in svc["spec"]["ports"]]


def test_monitoring_overlay_podmonitor_selects_the_jobs_pods():
    objs = d.kustomize(os.path.join(K8S, "overlays", "monitoring"))
    pm = _named(objs, "PodMonitor", "microd-train")
    labels = _one(objs, "Job")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"


def test_mtls_overlay_mounts_its_certificate_into_the_sidecar_only():
    objs = d.kustomize(os.path.join(K8S, "overlays", "mtls"))
    job = _one(objs, "Job")
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    env = _env(objs, sidecar)
    vols = set()
    for var, key in (("MICROD_TLS_CERT", "tls.crt"), ("MICROD_TLS_KEY", "tls.key"),
                     ("MICROD_TLS_CA", "ca.crt")):
        path = env[var]
        assert os.path.basename(path) == key, (var, path)
        vol = _volume_at(pod, sidecar, os.path.dirname(path))
        assert vol["secret"]["defaultMode"] & 0o077 == 0
        (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["readOnly"] is True
        vols.add(vol["secret"]["secretName"])
    (secret,) = vols
    certs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Certificate"}
    (cert,) = [c for c in certs.values() if c["spec"]["secretName"] == secret]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    coordinator_host = env["MICROD_COORDINATOR"].rsplit(":", 1)[0]
    assert coordinator_host in cert["spec"]["dnsNames"]
    assert env["MICROD_TLS_SERVER_NAME"] in cert["spec"]["dnsNames"]
    # The job's own CA signs it.
    issuer = _named(objs, "Issuer", cert["spec"]["issuerRef"]["name"])
    ca = [c for c in certs.values() if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]]
    assert ca and ca[0]["spec"]["isCA"] is True
    assert secret not in [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v
                          and v["name"] in [m["name"] for m in trainer.get("volumeMounts", [])]]


def test_elastic_overlay_serves_the_coordinator_alone_and_replaces_failed_pods():
    """overlays/elastic: a Deployment runs `microd --coordinator_only` behind
    its own Service, on the port every training node dials; no training node
    serves it; the job is elastic (--min_nodes below --nodes) and the Indexed
    Job replaces a failed pod (after it terminated), not counting preemptions;
    only the job's pods reach the coordinator."""
    objs = d.kustomize(os.path.join(K8S, "overlays", "elastic"))
    job = _one(objs, "Job")
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    env = _env(objs, sidecar)
    assert int(env["MICROD_MIN_NODES"]) < int(env["MICROD_NODES"]) == job["spec"]["completions"]
    assert int(env["MICROD_MAX_NODES"]) >= int(env["MICROD_NODES"])
    assert sidecar["args"] == ["exec microd"], "no training node serves the coordinator"
    assert job["spec"]["backoffLimitPerIndex"] >= 1
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert pod["restartPolicy"] == "Never"
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "Ignore" and rule["onPodConditions"] == [{"type": "DisruptionTarget"}]
    host, port = env["MICROD_COORDINATOR"].rsplit(":", 1)
    deployment = _named(objs, "Deployment", "microd-coordinator")
    assert deployment["spec"]["replicas"] == 1
    cpod = deployment["spec"]["template"]["spec"]
    (coordinator,) = cpod["containers"]
    script = coordinator["args"][0]
    assert "exec microd --coordinator_only" in script
    assert 'MICROD_COORDINATOR_LISTEN="0.0.0.0:${MICROD_COORDINATOR##*:}"' in script
    assert "unset MICROD_COORDINATOR" in script
    svc = _named(objs, "Service", host)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == "coordinator"]
    (cp,) = [p for p in coordinator["ports"] if p["name"] == "coordinator"]
    assert int(port) == sp["port"] == cp["containerPort"]
    # Every variable it reads is a flag; its token from the job's Secret.
    flags = {"MICROD_" + f.upper() for f in FLAGS}
    cenv = _env(objs, coordinator)
    assert all(name in flags for name in cenv), cenv
    path = cenv["MICROD_TOKEN_FILE"]
    vol = _volume_at(cpod, coordinator, os.path.dirname(path))
    assert vol["secret"]["secretName"] == "microd-token"
    assert cenv["MICROD_ADMIN"].startswith("unix:/")
    _volume_at(cpod, coordinator, os.path.dirname(cenv["MICROD_ADMIN"][len("unix:"):]))
    for probe in ("startupProbe", "livenessProbe"):
        assert coordinator[probe]["exec"]["command"][0] == "microd-health"
    assert coordinator["securityContext"]["allowPrivilegeEscalation"] is False
    assert cpod["securityContext"]["runAsNonRoot"] is True
    # Only the job's pods reach the coordinator's port.
    np = _named(objs, "NetworkPolicy", "microd-coordinator")
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    job_rule = np["spec"]["ingress"][0]
    (peer,) = job_rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= \
        job["spec"]["template"]["metadata"]["labels"].items()
    assert job_rule["ports"] == [{"protocol": "TCP", "port": "coordinator"}]
