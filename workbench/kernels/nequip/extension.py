"""``enable_WorkbenchKernels``: the workbench kernels as a nequip model modifier.

nequip imports this module when it is itself imported (the ``nequip.extension`` entry point
``init_always`` of this package), and it adds the modifier to nequip's
``TensorProductScatter`` the way nequip declares its own (``enable_CuEquivariance``,
``enable_OpenEquivariance``): a non-persistent ``@model_modifier`` classmethod. A nequip config
then switches kernels like this::

    model:
      _target_: nequip.model.modify
      modifiers:
        - modifier: enable_WorkbenchKernels
          backend: numba        # or torch (the reference), or e3nn (back)
      model:
        _target_: nequip.model.NequIPGNNModel
        ...

From Python, ``workbench.kernels.accelerate(model, backend="numba")`` does the same.
"""

from __future__ import annotations

MODIFIER = "enable_WorkbenchKernels"


def _enable(cls, model, backend: str = "numba"):
    """Run NequIP's message tensor product and scatter on the workbench's fused kernels (numba
    CUDA on GPU tensors, CPU loops otherwise); in place, the state dict unchanged. ``backend``:
    ``"numba"``, ``"torch"`` (the plain-torch reference) or ``"e3nn"`` (nequip's own modules)."""
    from workbench.kernels.acceleration import accelerate

    return accelerate(model, backend=backend)


def register() -> None:
    """Add the modifier to nequip's ``TensorProductScatter`` (once)."""
    from nequip.nn._tp_scatter_base import TensorProductScatter
    from nequip.nn.model_modifier_utils import model_modifier

    if MODIFIER in TensorProductScatter.__dict__:
        return
    modifier = model_modifier(persistent=False, private=False, supported_compile_modes=[])(classmethod(_enable))
    setattr(TensorProductScatter, MODIFIER, modifier)


register()
