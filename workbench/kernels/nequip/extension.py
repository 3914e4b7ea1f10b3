"""``enable_WorkbenchKernels``: the workbench kernels as a nequip model modifier.

nequip imports this module when it is itself imported (the ``nequip.extension`` entry point
``init_always`` of this package), and it adds the modifier to nequip's ``GraphModel`` (the
outer module of every NequIP and Allegro model) the way nequip and Allegro declare their own
(``enable_CuEquivariance``, ``enable_CuEquivarianceContracter``, ...): a non-persistent
``@model_modifier`` classmethod. A nequip config then switches kernels like this::

    model:
      _target_: nequip.model.modify
      modifiers:
        - modifier: enable_WorkbenchKernels
          backend: numba        # or torch (the reference), or e3nn (back)
      model:
        _target_: nequip.model.NequIPGNNModel     # or allegro.model.AllegroModel
        ...

From Python, ``workbench.kernels.accelerate(model)`` does the same.
"""

from __future__ import annotations

from workbench.kernels.registry import DEFAULT_BACKEND

MODIFIER = "enable_WorkbenchKernels"


def _enable(cls, model, backend: str = DEFAULT_BACKEND):
    """Run the model's hot ops (NequIP's message tensor product and scatter, Allegro's
    contraction) on the workbench's fused kernels (numba CUDA on GPU tensors, CPU loops
    otherwise), with the radial basis and the MLPs' SiLU in fewer passes; in place, the state
    dict unchanged. ``backend``:
    a registered backend: the default (the fused kernels), ``"torch"`` (the plain-torch
    reference) or ``"e3nn"`` (nequip's own modules)."""
    from workbench.kernels.acceleration import accelerate

    return accelerate(model, backend=backend)


def register() -> None:
    """Add the modifier to nequip's ``GraphModel``, the outer module of every NequIP and Allegro
    model (once). Allegro's classes cannot be imported while nequip itself is being imported."""
    from nequip.nn.graph_model import GraphModel
    from nequip.nn.model_modifier_utils import model_modifier

    if MODIFIER not in GraphModel.__dict__:
        modifier = model_modifier(persistent=False, private=False, supported_compile_modes=[])(classmethod(_enable))
        setattr(GraphModel, MODIFIER, modifier)


register()
