# Two commands do all the setup on a fresh machine:
#   make demo   - venv + install, then a LoRA job end to end on the embedded default
#   make test   - venv + install, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

demo: setup
	$(BIN)/ftune demo

test: setup
	$(BIN)/python -m pytest

# Everything but the tests that run the whole stack or real multi-process training.
test-fast: setup
	$(BIN)/python -m pytest -m "not e2e"

bench: setup
	$(BIN)/python bench/service_overhead.py

clean:
	rm -rf $(VENV) .ftune .ftune-demo
