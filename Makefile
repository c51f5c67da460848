# Thin wrapper: everything real lives in CMake and scripts/.
#   make test   installs what is missing, configures, builds and runs every test
#   make demo   the main job: Fashion-MNIST through a local cluster, MiCRO vs dense
#               (DEMO_ARGS="--epochs 5 --density 0.001" etc.)
#   make bench  benchmark programs (figures printed beside their baselines)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test demo bench clean

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

demo: build
	bash scripts/demo.sh $(BUILD) $(DEMO_ARGS)

bench: build
	mkdir -p results/bench
	$(BUILD)/bench/microd-bench-kernels --json=results/bench/kernels.json
	$(BUILD)/bench/microd-bench-transport --json=results/bench/transport.json
	$(BUILD)/bench/microd-bench-daemon --json=results/bench/daemon.json

clean:
	rm -rf $(BUILD)
