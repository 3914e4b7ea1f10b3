# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# torch first: this pin takes the CPU wheel on disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test lab venv bench-packing clean-venv system-deps

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev,lab]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/workbench demo

# Tests start a real single-node SLURM (slurm-wlm + munge) and drive JupyterLab in Debian chromium.
SYSTEM_PKGS := slurm-wlm munge chromium
system-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing $(SYSTEM_PKGS) (apt-get)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PKGS) >/dev/null; \
	else echo "note: $(SYSTEM_PKGS) missing and not root; the SLURM and browser tests will be skipped"; fi

test: $(STAMP) system-deps
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

# JupyterLab refuses to start as root unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks $(LAB_ARGS)

bench-packing: $(STAMP)
	$(VENV)/bin/workbench bench packing

clean-venv:
	rm -rf $(VENV)
