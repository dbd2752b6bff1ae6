# memfit — the two set-up commands are `make run` and `make test`.
# LIBTORCH=debian (Debian's libtorch-dev 1.13, the default) or pip (PyPI's
# torch 2.15 with CUDA, installed by scripts/install-torch.sh into a venv
# under ~/.cache/memfit); each has its own build folder.
LIBTORCH  ?= debian
ifeq ($(LIBTORCH),debian)
BUILD_DIR ?= build
else ifeq ($(LIBTORCH),pip)
BUILD_DIR ?= build-pip
DEPS_FLAGS = --torch
else
$(error LIBTORCH is '$(LIBTORCH)'; use LIBTORCH=debian (Debian's libtorch-dev 1.13) or LIBTORCH=pip (PyPI's torch 2.15))
endif
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
# A compiler cache when there is one (scripts/install-deps.sh installs ccache);
# the sloppiness lets it cache the sources that use the precompiled header.
CCACHE    := $(shell command -v ccache 2>/dev/null)
ifneq ($(CCACHE),)
CACHE_FLAGS = -DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE)
export CCACHE_SLOPPINESS = pch_defines,time_macros,include_file_mtime,include_file_ctime
endif
# $(call timed,STAGE,COMMAND) runs COMMAND and prints how long STAGE took.
timed = @start=$$(date +%s); $(2); rc=$$?; echo "make: $(1) took $$(( $$(date +%s) - start )) s"; exit $$rc

# The main job: one epoch of a ResNet-style CNN on Fashion-MNIST under a 64 MiB budget.
RUN_ARGS  ?= train --model resnet --epochs 1 --budget 64MiB --report $(BUILD_DIR)/run-report.json

.PHONY: all deps configure build build-cli test run bench install clean

all: build

deps:
	$(call timed,install,bash scripts/install-deps.sh $(DEPS_FLAGS))

# Configured on every make (about 2 s), so a changed LIBTORCH is never built
# against the LibTorch an older configure found.
configure: deps
	$(call timed,configure,cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DMEMFIT_LIBTORCH=$(LIBTORCH) $(CACHE_FLAGS) $(CMAKE_FLAGS))

build: configure
	$(call timed,build,cmake --build $(BUILD_DIR) -j $(JOBS))

# The main job needs only the library and the CLI, not the tests and benchmarks.
build-cli: configure
	$(call timed,build (library and CLI),cmake --build $(BUILD_DIR) -j $(JOBS) --target memfit_cli)

test: build
	$(call timed,tests,cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS))

run: build-cli
	$(call timed,the run,$(abspath $(BUILD_DIR))/memfit $(RUN_ARGS))

bench: build
	$(abspath $(BUILD_DIR))/bench/memfit_bench
	$(abspath $(BUILD_DIR))/bench/memfit_checkpoint_bench
	$(abspath $(BUILD_DIR))/bench/memfit_precision_bench
	$(abspath $(BUILD_DIR))/bench/memfit_trainer_bench
	$(abspath $(BUILD_DIR))/bench/memfit_plan_bench
	$(abspath $(BUILD_DIR))/bench/memfit_distributed_bench

install: build
	cmake --install $(BUILD_DIR) $(if $(PREFIX),--prefix $(PREFIX),)

clean:
	rm -rf $(BUILD_DIR)
