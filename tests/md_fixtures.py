"""A tiny mace model and a structure for ``workbench md`` runs (shared by the test modules)."""

import ase.io
import pytest
import torch
from kernel_fixtures import build_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random (non-zero) mace ScaleShiftMACE for H and O, saved as mace saves models, and a
    water cluster of the embedded data."""
    from workbench.data import load_embedded

    d = tmp_path_factory.mktemp("md")
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 2, dtype=torch.float64)
    model.atomic_numbers = torch.tensor([1, 8])
    torch.save(model, d / "tiny.model")
    cluster = next(a for a in load_embedded() if a.info["config_type"] == "water_clusters")
    ase.io.write(d / "cluster.xyz", cluster)
    return d / "tiny.model", d / "cluster.xyz"
