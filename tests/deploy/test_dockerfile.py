# SPDX-License-Identifier: Apache-2.0
"""Lint of the root Dockerfile (no Docker engine here): its stages, that every
path it copies exists in the build context, that the build stage runs the
scripts the install test runs, and what the runtime image promises (non-root
user, the socket folder as a volume, a health check, microd as entry point).
The files the build stage copies are configured with CMake in a scratch
folder, the way the image build would."""
import os
import re
import shutil
import subprocess

import deploy_lib as d

DOCKERFILE = os.path.join(d.ROOT, "Dockerfile")
ARGS, STAGES = d.parse_dockerfile(DOCKERFILE)
BUILD = next((s for s in STAGES if s.name == "build"), None)
RUNTIME = STAGES[-1]


def _env(stage):
    env = {}
    for arg in stage.all("ENV"):
        for m in re.finditer(r'(\w+)=("[^"]*"|\S+)', arg):
            env[m.group(1)] = m.group(2).strip('"')
    return env


def test_stages():
    assert len(STAGES) >= 2 and BUILD is not None and RUNTIME.name == "runtime"
    assert BUILD.index < RUNTIME.index
    # The base images are build arguments (a CUDA image for GPU builds).
    assert BUILD.base == "${BUILD_IMAGE}" and "BUILD_IMAGE" in ARGS
    assert RUNTIME.base == "${RUNTIME_IMAGE}" and "RUNTIME_IMAGE" in ARGS
    # Runtime packages are installed by name: one distribution for both.
    assert ARGS["RUNTIME_IMAGE"].startswith(ARGS["BUILD_IMAGE"])


def test_every_copied_path_exists_and_is_in_the_context():
    patterns = d.dockerignore_patterns()
    names = {s.name for s in STAGES}
    for stage in STAGES:
        for arg in stage.all("COPY") + stage.all("ADD"):
            src_from, sources, _ = d.copy_sources(arg)
            if src_from is not None:
                earlier = {s.name for s in STAGES[:stage.index]}
                assert src_from in earlier, f"COPY --from={src_from}: no earlier stage ({names})"
                continue
            for src in sources:
                path = os.path.join(d.ROOT, src)
                assert os.path.exists(path), f"COPY {src}: no such path"
                assert not d.dockerignored(src, patterns), f"COPY {src}: excluded by .dockerignore"


def test_build_stage_runs_the_scripts_the_tests_run():
    runs = " ".join(BUILD.all("RUN"))
    assert "scripts/install-deps.sh --build" in runs
    assert "scripts/build-install.sh" in runs and "--runtime-packages" in runs
    install_test = open(os.path.join(d.ROOT, "tests", "deploy", "install_test.sh")).read()
    assert "scripts/build-install.sh" in install_test and "--runtime-packages" in install_test
    # What the runtime stage copies from the build stage is what it installed.
    prefix = re.search(r"--prefix (\S+)", runs).group(1)
    packages = re.search(r"--runtime-packages (\S+)", runs).group(1)
    froms = [d.copy_sources(a) for a in RUNTIME.all("COPY")]
    copied = [s.rstrip("/") for f, srcs, _ in froms if f == "build" for s in srcs]
    assert prefix.rstrip("/") in copied and packages in copied


def test_runtime_user_is_not_root():
    users = RUNTIME.all("USER")
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user
    # The Kubernetes pods run as the same uid (the socket is 0600).
    job = open(os.path.join(d.ROOT, "deploy", "k8s", "base", "job.yaml")).read()
    assert f"runAsUser: {user}" in job


def test_socket_folder_is_a_volume():
    socket = _env(RUNTIME).get("MICROD_SOCKET", d.microd_flags()["socket"]["default"])
    assert socket == d.microd_flags()["socket"]["default"]
    volumes = " ".join(RUNTIME.all("VOLUME"))
    assert f'"{os.path.dirname(socket)}"' in volumes or os.path.dirname(socket) in volumes.split()
    # The folder exists in the image, owned by the runtime user.
    assert os.path.dirname(socket) in " ".join(RUNTIME.all("RUN"))


def test_health_check_and_entrypoint():
    (health,) = RUNTIME.all("HEALTHCHECK")
    cmd = health.split(" CMD ", 1)[1]
    assert cmd.startswith('["microd-health"'), health
    # microd-health is installed into bin/ (the prefix is copied to /usr/local).
    daemon_cmake = open(os.path.join(d.ROOT, "daemon", "CMakeLists.txt")).read()
    assert re.search(r"install\(TARGETS[^)]*microd-health[^)]*DESTINATION \$\{CMAKE_INSTALL_BINDIR\}",
                     daemon_cmake)
    assert RUNTIME.all("ENTRYPOINT") == ['["microd"]']


def test_copied_files_configure(tmp_path):
    """The build stage's COPY set is enough for CMake (what `docker build` needs)."""
    ctx = tmp_path / "src"
    for arg in BUILD.all("COPY"):
        src_from, sources, dest = d.copy_sources(arg)
        for src in sources:
            target = ctx / (dest if not dest.endswith("/") and dest != "./" else
                            os.path.join(dest, os.path.basename(src.rstrip("/"))))
            if dest.endswith("/") and src.endswith("/"):
                target = ctx / dest
            path = os.path.join(d.ROOT, src)
            if os.path.isdir(path):
                shutil.copytree(path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
                    "__pycache__", "build", "*.egg-info"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    r = subprocess.run([str(ctx / "scripts" / "build-install.sh"), "--configure-only",
                        "--prefix", str(tmp_path / "prefix"), "--build-dir", str(tmp_path / "build"),
                        "--", "-DMICROD_ENABLE_CUDA=OFF"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Generating done" in r.stdout and "configured" in r.stdout, r.stdout[-3000:]
    print(r.stdout[-400:])
