import os

# e3nn 0.4.4 needs this under torch >= 2.6; workbench sets it on import, but tests may import mace first.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the CPU kernels leave outputs they fully write uninitialised: NaN there makes a missed element fail a test
os.environ.setdefault("WORKBENCH_KERNELS_POISON", "1")


import importlib.metadata

import pytest


def _installed(dist: str) -> bool:
    # not importlib.util.find_spec: tests/ is on sys.path, where a folder could pass for a package
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# tests/nequip_env run in the NequIP venv (`make test-nequip`): nequip needs e3nn >= 0.6, mace-torch 0.4.4
collect_ignore = [] if _installed("nequip") else ["nequip_env"]
# The default CPU kernels ("auto") compile one fused kernel per small row pass, about a second
# each on a cold cache, and the suites build hundreds of model configurations: they run on the
# interpreter, which compiles once. The fused kernels are tested pass by pass against it
# (test_kernels_cpu_fused.py) and end to end, on the default, by MACE training
# (test_train.py::test_numba_backend_trains_like_e3nn) and the NequIP and Allegro parity tests
# of their tutorial-sized configurations (nequip_fixtures.default_cpu_kernels).
os.environ.setdefault("WORKBENCH_CPU_KERNELS", "interpreter")


@pytest.fixture(autouse=True)
def _kernel_options_set_in_code():
    """Kernel options a test sets in code (``configure``: the ``--cache`` of a CLI test, a
    benchmark's variant) end with the test, as ``monkeypatch`` ends the variables it sets."""
    from workbench.kernels import options

    saved = options._SET
    yield
    options._SET = saved


# Under pytest-xdist ``make test`` runs ``-n 2 --dist loadfile``: a module runs whole on one
# worker, so its module fixtures (a JupyterLab, compiled kernels, a prepared store) start once.
# Session fixtures start once per worker that needs them (LocalSlurm picks free ports, so two
# clusters can run side by side).


# --- workbench.launch: a real single-node SLURM for the session ---


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real SLURM (munged + slurmctld + slurmd on 127.0.0.1) shared by the session.

    Yields a started :class:`local_slurm.LocalSlurm`; point clients at it with
    ``monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])`` (or ``cluster.env``
    for a subprocess). Skips only when the daemons are not installed; a cluster that is
    installed but does not start is an error.
    """
    from local_slurm import LocalSlurm, missing_daemons

    missing = missing_daemons()
    if missing:
        pytest.skip(
            f"SLURM is not installed here ({', '.join(missing)} missing); "
            "`make system-deps` or apt-get install slurm-wlm munge"
        )
    # requeued jobs start again after 6 s, not SLURM's default 121 s, as nothing else forces them
    cluster = LocalSlurm(requeue_delay_s=6).start()
    try:
        yield cluster
    finally:
        cluster.stop()


# --- scheduling: the long modules first ---

#: modules of a minute or more on 2 CI cores, longest first. ``--dist loadfile`` hands out whole
#: modules in collection order (``make test`` passes --no-loadscope-reorder: xdist's own order,
#: by test count, put these few-test modules last, where one of them alone bounded the wall time).
LONG_MODULES = (
    "test_two_node.py",
    "test_launch.py",
    "test_notebooks.py",
    "test_browser.py",
    "test_bench_step.py",
    "test_bench_cpu.py",
)


def _module_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: every module keeps its own test order (test_launch.py's tests depend on theirs)
    items.sort(key=_module_rank)
