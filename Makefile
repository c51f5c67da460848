# Thin wrapper: everything real lives in CMake and scripts/.
#   make test   installs what is missing, configures, builds and runs the tests
#               (all but the few long ones, each a minute or more)
#   make test-long  the long ones: the smoke run of every benchmark, elastic and
#               long training runs, packaging, the soak's short form (.ci/run runs both)
#   make demo   the main job: Fashion-MNIST through a local cluster, MiCRO vs dense
#               (DEMO_ARGS="--epochs 5 --density 0.001" etc.)
#   make bench  every benchmark, then one report beside PyTorch DDP
#               (results/bench/report.md; BENCH_ARGS="--skip-training" etc.)
#   make soak   the chaos soak: jobs on the emulated cluster under random faults
#               (root; SOAK_SECONDS=7200, SOAK_ARGS="--seed 3 --fault_every 30-60")
#   make test-asan / make test-tsan   the suites under ASan + UBSan / TSan
#   make format / make format-check   rewrite / check the C, C++ and CUDA files
#               against .clang-format (the CI runs the check)
#   make fuzz   each fuzz target under libFuzzer (FUZZ_SECONDS=120 each)
#   make coverage   the lines of each module its unit tests run (gcov/lcov;
#               build-cov/coverage.txt)
#   make gpu-bundle        the GPU checks built here and packed for a GPU machine
#                          (build/gpu-bundle, checked here; run.sh runs them there)
#   make gpu-bundle-check  checks an existing bundle again
#   make image             the Dockerfile built with podman as microd:test (root;
#                          Debian base images made here, no registry)
#   make image-test        the image run for real: size, --help, health, a job in
#                          containers (root; builds the image when missing)
BUILD ?= build
JOBS ?= $(shell nproc)
# make test runs one test more than there are cores: a third of its tests'
# time is waiting (for a peer timeout, a daemon to start), and at nproc the
# cores were 64 % busy (2 cores: 362 s at -j2, 297 s at -j3).
TEST_JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))
CMAKE_FLAGS ?=

.PHONY: all deps configure build test test-long soak test-asan test-tsan fuzz coverage gpu-bundle gpu-bundle-check demo bench clean \
	image image-test format format-check

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(TEST_JOBS) --timeout 600 -LE long

test-long: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1500 -L long

SOAK_SECONDS ?= 7200
SOAK_ARGS ?=
soak: build
	$(BUILD)/tests/microd-soak --seconds=$(SOAK_SECONDS) $(SOAK_ARGS)

test-asan: deps
	bash scripts/sanitize.sh address

test-tsan: deps
	bash scripts/sanitize.sh thread

format: deps
	bash scripts/check-format.sh --fix

format-check: deps
	bash scripts/check-format.sh

fuzz:
	bash scripts/fuzz.sh

coverage:
	bash scripts/coverage.sh

gpu-bundle:
	bash scripts/gpu-bundle.sh

gpu-bundle-check:
	bash scripts/gpu-bundle-check.sh

image:
	bash scripts/image.sh

image-test: image
	bash scripts/image-test.sh

demo: build
	bash scripts/demo.sh $(BUILD) $(DEMO_ARGS)

bench: build
	bash scripts/bench.sh $(BUILD) $(BENCH_ARGS)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz build-gpu build-cov
