# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# torch first: this pin takes the CPU wheel on disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test lab venv bench-packing clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev,lab]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/workbench demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

bench-packing: $(STAMP)
	$(VENV)/bin/workbench bench packing

clean-venv:
	rm -rf $(VENV)
