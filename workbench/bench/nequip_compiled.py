"""The ``aoti`` row of ``workbench bench nequip``: the family's own model as a NequIP user runs MD
on a CPU, compiled ahead of time.

NequIP's documentation recommends ``nequip-compile --mode aotinductor --target ase`` for MD:
``torch.export`` of the model with dynamic atom and edge counts, then AOTInductor's C++ build,
loaded by ``NequIPCalculator.from_compiled_model``. ``nequip-compile`` reads a checkpoint or a
package, and the bench's models come from the builder, so :func:`aoti_model` calls the same
public steps on the model object: the ASE target's inputs and outputs, the model's metadata
with the global state, ``nequip.utils.aot.aot_export_model`` (which checks the compiled model
against the eager one), and ``load_compiled_model``. The build takes minutes on 2 cores; the
row runs only when asked for (``--backends aoti``), on the CPU, MD only: a compiled model has
no parameters to train.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

__all__ = ["AOTI", "aoti_model"]

AOTI = "aoti"


def _metadata(model: Any, inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """The strings ``nequip-compile`` stores beside the compiled model (what its loader reads)."""
    from nequip.utils.aoti_metadata import NEQUIP_AOTI_INPUTS_KEY, NEQUIP_AOTI_OUTPUTS_KEY, serialize_aoti_keys
    from nequip.utils.global_state import get_latest_global_state

    meta = {**model.metadata, **get_latest_global_state(only_metadata_related=True)}
    meta = {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in meta.items()}
    meta[NEQUIP_AOTI_INPUTS_KEY] = serialize_aoti_keys(inputs)
    meta[NEQUIP_AOTI_OUTPUTS_KEY] = serialize_aoti_keys(outputs)
    return meta


def aoti_model(native: Any, data: dict, path: str | Path, device: str = "cpu") -> Any:
    """``native`` (a NequIP ``GraphModel``, unchanged) compiled for the ASE target into ``path``
    (``*.nequip.pt2``) from the sample ``data``, and loaded back as NequIP's calculator loads
    it: a module from a data dict to the target's outputs. A LookupError off the CPU."""
    if device != "cpu":
        raise LookupError(f"the {AOTI} row is built and timed on the CPU here, not on {device}")
    import torch
    from nequip.integrations.ase import NequIPCalculator
    from nequip.model.inference_models import load_compiled_model
    from nequip.utils.aot import aot_export_model

    path = Path(path)
    if not path.name.endswith(".nequip.pt2"):
        raise ValueError(f"{path}: an AOTInductor model file must end in .nequip.pt2")
    path.parent.mkdir(parents=True, exist_ok=True)
    target = NequIPCalculator._get_aoti_compile_target()
    inputs, outputs = list(target["input"]), list(target["output"])
    dims = {"graph": "num_frames", "node": "num_nodes", "edge": "num_edges"}  # nequip-compile's defaults: 2..inf
    batch_map = target["batch_map_settings"]({k: torch.export.Dim(n, min=2) for k, n in dims.items()})
    sample = target["data_settings"]({k: v.clone() for k, v in data.items()})
    model = copy.deepcopy(native).eval()
    configs = {"aot_inductor.metadata": _metadata(model, inputs, outputs)}
    aot_export_model(model, device, inputs, outputs, sample, batch_map, str(path), inductor_configs=configs)
    compiled, _ = load_compiled_model(str(path), device, inputs, outputs)
    return compiled
