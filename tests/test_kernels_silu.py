"""SiLU with one-pass derivatives (:mod:`workbench.kernels.e3nn.silu`): torch's values and
derivatives at every order (float64 to rounding, float32 against float64), the numba pass for
the second derivative on the CPU and torch ops otherwise, and the in-place module swap."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import silu as silu_module
from workbench.kernels.e3nn.silu import SWAP, silu


def _z(seed: int, shape=(37, 9), dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (4.0 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()


@pytest.fixture
def cpu_passes(monkeypatch) -> list:
    """Every call of the numba second-derivative pass."""
    calls: list = []
    real = silu_module._second_cpu

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(silu_module, "_second_cpu", spy)
    return calls


def _three_orders(f, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """f(z), then three nested gradients with random cotangents (each a function of the last)."""
    g = torch.Generator().manual_seed(7)
    y = f(z)
    v = [torch.randn(s, generator=g, dtype=torch.float64).to(z.dtype) for s in (y.shape, z.shape, z.shape)]
    (d1,) = torch.autograd.grad((y * v[0]).sum(), z, create_graph=True)
    (d2,) = torch.autograd.grad((d1 * v[1]).sum(), z, create_graph=True)
    (d3,) = torch.autograd.grad((d2 * v[2]).sum(), z)
    return y, d1, d2, d3


@pytest.mark.parametrize("fused", [True, False])
def test_values_and_three_derivatives_match_torch_in_float64(fused, cpu_passes):
    z = _z(1)
    ours = _three_orders(lambda t: silu(t, fused), z)
    ref = _three_orders(torch.nn.functional.silu, z)
    for order, (a, b) in enumerate(zip(ours, ref)):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), order
    assert bool(cpu_passes) == fused  # the numba pass ran exactly when asked for


@pytest.mark.parametrize("fused", [True, False])
def test_gradcheck_and_gradgradcheck(fused):
    z = _z(2, (11, 5))
    assert gradcheck(lambda t: silu(t, fused), (z,))
    assert gradgradcheck(lambda t: silu(t, fused), (z,))
    # the second derivative's own backward (the third order) against finite differences
    g, h = _z(3, (11, 5)), _z(4, (11, 5))
    assert gradcheck(lambda a, b, c: silu_module._SiLUGrad2.apply(a, b, c, fused), (z, g, h))


def test_float32_against_float64_and_strided_input(cpu_passes):
    z64 = _z(5, (64, 24))
    ref = _three_orders(silu, z64)
    z32 = z64.detach().float().t().contiguous().t().requires_grad_()  # column-major: not contiguous
    assert not z32.is_contiguous()
    got = _three_orders(silu, z32)
    for order, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), order
    assert len(cpu_passes) == 2  # float64 and float32


def test_small_inputs_keep_torchs_silu(cpu_passes, monkeypatch):
    """Below MIN_ELEMENTS, and in eval(), the module is torch's SiLU (the Functions cost more
    than they save)."""
    act = torch.nn.SiLU()
    SWAP.swap(act, "numba")
    monkeypatch.setitem(silu_module.MIN_ELEMENTS, torch.float64, 50)
    small, large = _z(8, (7, 7)), _z(9, (8, 7))  # 49 and 56 elements
    assert act(small).grad_fn.name() == "SiluBackward0"
    assert act(large).grad_fn.name() == "_SiLUBackward"
    for z in (small, large):
        got = _three_orders(act, z)
        ref = _three_orders(torch.nn.functional.silu, z)
        assert all((a - b).abs().max() <= 1e-12 * b.abs().max() for a, b in zip(got, ref))
    assert len(cpu_passes) == 1  # the large input's second derivative only
    act.eval()  # an MD step: torch's SiLU at every size, still right to every order
    assert act(large).grad_fn.name() == "SiluBackward0"
    got, ref = _three_orders(act, large), _three_orders(torch.nn.functional.silu, large)
    assert all((a - b).abs().max() <= 1e-12 * b.abs().max() for a, b in zip(got, ref)) and len(cpu_passes) == 1


def test_module_swap_in_place_and_back(cpu_passes, monkeypatch):
    monkeypatch.setitem(silu_module.MIN_ELEMENTS, torch.float64, 0)
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.SiLU(), torch.nn.Linear(6, 2)).double()
    ref = torch.nn.Sequential(*list(mlp))  # the same modules: a second view of the model
    x = _z(6, (5, 3))
    before = _three_orders(mlp, x)
    act = mlp[1]
    SWAP.swap(act, "numba")
    assert act is mlp[1] and isinstance(act, SWAP.ours()) and SWAP.is_ours(act)
    after = _three_orders(ref, x)
    for a, b in zip(after, before):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    assert cpu_passes
    cpu_passes.clear()
    SWAP.swap(act, "torch")  # the reference backend: torch ops only
    _three_orders(mlp, x)
    assert not cpu_passes
    SWAP.unswap(act)
    assert type(act) is torch.nn.SiLU and "kernel_backend" not in act.__dict__
