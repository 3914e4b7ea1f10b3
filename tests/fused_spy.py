"""A record of the fused CPU passes a test runs, for the tests of both environments: a test on
the fused kernels must not quietly compare the interpreter with itself."""

from __future__ import annotations


def spy_fused_runs(monkeypatch) -> list:
    """Patch :meth:`FusedPass.run` to append every fused pass it runs to the returned list."""
    from workbench.kernels.numba.cpu import fused as cpu_fused

    runs: list = []
    original = cpu_fused.FusedPass.run

    def spy(self, *args, **kwargs):
        runs.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cpu_fused.FusedPass, "run", spy)
    return runs
