# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch first: this pin takes the CPU wheel on disk; an unpinned torch pulls a multi-GB CUDA build.
# --no-compile, then compileall on all cores: the same .pyc files (needed: PYTHONDONTWRITEBYTECODE
# may be set, and then nothing is cached on import) in ~50 s instead of pip's serial ~100 s.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# Installs go through the lock (exact versions the suite was last green with); `LOCK=` takes the
# newest releases instead. `make lock` refreshes requirements.lock and environment.yml.
LOCK   ?= requirements.lock
INSTALL_FLAGS := $(if $(LOCK),-c $(LOCK),--upgrade --upgrade-strategy eager)
STAMP  := $(VENV)/.installed$(if $(LOCK),-locked,-latest)
# cuEquivariance's Python layers (pure Python, CPU too), kept off the main environment's path: with
# them importable the cueq backend counts as available. Tests that read a model saved with
# cuEquivariance layers put this folder on a subprocess's PYTHONPATH (tests/test_finetune_cueq.py).
CUEQ_LIB  := $(VENV)/cueq-lib
CUEQ_PKGS ?= cuequivariance==0.13.0 cuequivariance-torch==0.13.0

.PHONY: demo test test-nequip lint docs docs-serve lab venv lock lock-nequip bench-packing bench-cpu clean-venv system-deps

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip $(if $(LOCK),-c $(LOCK),)
	$(PIP) install -q --no-compile $(TORCH) $(if $(LOCK),-c $(LOCK),)
	$(PIP) install -q --no-compile -e '.[dev,lab,mace,docs]' $(INSTALL_FLAGS)
	@$(PY) -m compileall -q -j 0 $(VENV)/lib/python*/site-packages >/dev/null || true  # a few packages ship files that do not compile, as with pip
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/workbench demo

# ruff lint + format check (settings in pyproject.toml), run first by `make test`; `make format` rewrites in place.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The documentation site (mkdocs.yml, docs/): strict, so a broken link, a missing page or a
# docstring griffe cannot parse fails the build. `make docs-serve` rebuilds on every edit.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean -q

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict

# Tests start a real single-node SLURM (slurm-wlm + munge) and drive JupyterLab in Debian chromium.
SYSTEM_PKGS := slurm-wlm munge chromium
system-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing $(SYSTEM_PKGS) (apt-get)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PKGS) >/dev/null; \
	else echo "note: $(SYSTEM_PKGS) missing and not root; the SLURM and browser tests will be skipped"; fi

# Two pytest workers (pytest-xdist), a test module whole on one worker: many tests are
# single-threaded, so both cores stay busy. TEST_WORKERS=0 runs everything in one process.
# (Not --dist loadgroup: under pytest 9 its group suffix no longer reaches the scheduler.)
# --no-loadscope-reorder: modules go out in collection order, where tests/conftest.py puts the long
# ones (LONG_MODULES) first; xdist's default order (most tests first) left them for last.
TEST_WORKERS ?= 2
# The NequIP environment is built first: notebook 06 (in the main run) measures through it.
NEQUIP_VENV ?= .venv-nequip
NEQUIP_LOCK ?= requirements-nequip.lock
NEQUIP_PY   := $(NEQUIP_VENV)/bin/python
NEQUIP_STAMP := $(NEQUIP_VENV)/.installed
$(CUEQ_LIB)/.installed: $(STAMP)
	rm -rf $(CUEQ_LIB) && $(PIP) install -q --no-deps --no-compile --target $(CUEQ_LIB) $(CUEQ_PKGS)
	@touch $@

test: $(STAMP) $(NEQUIP_STAMP) $(CUEQ_LIB)/.installed lint system-deps
	WORKBENCH_LOCK="$(LOCK)" $(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-nequip

# NequIP and Allegro (nequip needs e3nn >= 0.6, mace-torch pins 0.4.4): their own venv and lock
# (NEQUIP_* above), and the tests under tests/nequip_env, which the main run leaves out (tests/conftest.py).
$(NEQUIP_STAMP): pyproject.toml $(NEQUIP_LOCK)
	@test -x $(NEQUIP_PY) || $(PYTHON) -m venv $(NEQUIP_VENV)
	$(NEQUIP_PY) -m pip install -q --upgrade pip -c $(NEQUIP_LOCK)
	$(NEQUIP_PY) -m pip install -q --no-compile $(TORCH) -c $(NEQUIP_LOCK)
	$(NEQUIP_PY) -m pip install -q --no-compile -e '.[nequip]' pytest pytest-timeout -c $(NEQUIP_LOCK)
	@$(NEQUIP_PY) -m compileall -q -j 0 $(NEQUIP_VENV)/lib/python*/site-packages >/dev/null || true
	@touch $@

test-nequip: $(NEQUIP_STAMP)
	$(NEQUIP_PY) -m pytest -q --durations=5 -p no:cacheprovider tests/nequip_env

# Resolve the NequIP environment afresh and pin what it got.
lock-nequip:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[nequip]' pytest pytest-timeout
	$(LOCK_VENV)/bin/python .ci/lock.py --nequip $(LOCK_VENV)/bin/python
	rm -rf $(LOCK_VENV)

# Resolve everything afresh in a scratch venv (no constraints) and pin what it got.
LOCK_VENV ?= .venv-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[dev,lab,mace,docs]'
	$(LOCK_VENV)/bin/python .ci/lock.py $(LOCK_VENV)/bin/python
	rm -rf $(LOCK_VENV)
	@echo "now run 'make test' to check the new pins, and commit requirements.lock + environment.yml"

# JupyterLab refuses to start as root unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks $(LAB_ARGS)

bench-packing: $(STAMP)
	$(VENV)/bin/workbench bench packing

# MACE, NequIP and Allegro on this CPU against their own paths (the families part runs in .venv-nequip).
bench-cpu: $(STAMP) $(NEQUIP_STAMP)
	$(VENV)/bin/workbench bench cpu --nequip-python $(NEQUIP_PY)

clean-venv:
	rm -rf $(VENV)
