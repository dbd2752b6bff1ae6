# memfit — the two set-up commands are `make run` and `make test`.
BUILD_DIR ?= build
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
# The main job: one epoch of a ResNet-style CNN on Fashion-MNIST under a 64 MiB budget.
RUN_ARGS  ?= train --model resnet --epochs 1 --budget 64MiB --report $(BUILD_DIR)/run-report.json

.PHONY: all deps configure build test run bench install clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

run: build
	./$(BUILD_DIR)/memfit $(RUN_ARGS)

bench: build
	./$(BUILD_DIR)/bench/memfit_bench
	./$(BUILD_DIR)/bench/memfit_checkpoint_bench
	./$(BUILD_DIR)/bench/memfit_precision_bench
	./$(BUILD_DIR)/bench/memfit_trainer_bench
	./$(BUILD_DIR)/bench/memfit_plan_bench
	./$(BUILD_DIR)/bench/memfit_distributed_bench

install: build
	cmake --install $(BUILD_DIR) $(if $(PREFIX),--prefix $(PREFIX),)

clean:
	rm -rf $(BUILD_DIR)
