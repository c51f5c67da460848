# syntax=docker/dockerfile:1
# microd image: the sidecar daemon (microd), microctl, microd-health and the
# client library, built with the same script the install test runs
# (scripts/build-install.sh; tests/deploy/ lints this file).
#
#   docker build -t microd:0.1.0 .
#   GPU build (the CUDA toolkit and NCCL come with the base image; CMake finds
#   nvcc under /usr/local/cuda; both images must be the same distribution):
#   docker build --build-arg BUILD_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#     --build-arg RUNTIME_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 -t microd:0.1.0-cuda .
ARG BUILD_IMAGE=debian:bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

# --- build: Debian packages of scripts/install-deps.sh --build, then build and
# install into /opt/microd; the runtime packages are listed for the next stage.
FROM ${BUILD_IMAGE} AS build
ARG JOBS=4
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN bash scripts/install-deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY CMakeLists.txt ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY kernels/ kernels/
COPY client/ client/
COPY daemon/ daemon/
COPY scripts/build-install.sh scripts/build-install.sh
RUN scripts/build-install.sh --prefix /opt/microd --build-dir /src/build --jobs "${JOBS}" \
      --runtime-packages /opt/microd-runtime-packages.txt

# --- runtime: only the shared libraries' packages, the installed prefix and an
# unprivileged user.
FROM ${RUNTIME_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /opt/microd-runtime-packages.txt /tmp/microd-runtime-packages.txt
# The apt caches go in this layer whatever the base's apt settings (images
# without the official ones' docker-clean keep 80 MB of them otherwise).
RUN apt-get update -qq \
    && xargs -a /tmp/microd-runtime-packages.txt apt-get install -y -qq --no-install-recommends \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
       /tmp/microd-runtime-packages.txt
COPY --from=build /opt/microd/ /usr/local/
RUN ldconfig \
    && groupadd --system --gid 10001 microd \
    && useradd --system --uid 10001 --gid microd --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin microd \
    && install -d -o microd -g microd -m 0750 /run/microd
# Training processes must run as this uid (or set MICROD_ALLOW_GID): the
# socket is 0600 and peers are checked with SO_PEERCRED.
USER 10001:10001
ENV MICROD_SOCKET=/run/microd/microd.sock
# Share it with the training containers (docker run -v microd-sock:/run/microd).
VOLUME ["/run/microd"]
# The coordinator (node 0). Admin is a Unix socket beside the training one
# (MICROD_ADMIN, default unix:/run/microd/admin.sock, this uid only);
# Gloo's data plane uses ephemeral ports (run on the host network or one
# user-defined network).
EXPOSE 7470
# grpc.health.v1 on the Admin socket: "" while the daemon answers.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["microd-health", "--timeout_ms=3000"]
ENTRYPOINT ["microd"]
