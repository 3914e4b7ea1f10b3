"""The companion swaps of both nequip-built families (NequIP's message, Allegro's contracter):
the modules nequip's builders put around the hot op, each faster as fewer, larger calls.

* :mod:`.edge_vectors`: the spherical harmonics' edge vectors, frame by frame;
* :mod:`.radial`: the Bessel edge encoding and its polynomial cutoff;
* :mod:`workbench.kernels.e3nn.silu`: the radial MLPs' SiLU;
* :mod:`workbench.kernels.e3nn.spherical_harmonics`: the edges' spherical harmonics (in ``eval()``);
* :mod:`workbench.kernels.e3nn.linear`: e3nn's ``Linear``;
* :mod:`workbench.kernels.e3nn.gate`: e3nn's ``Gate``;
* :mod:`workbench.kernels.e3nn.scalar_tp`: the self-connection, e3nn's
  ``FullyConnectedTensorProduct`` with the species embedding.
"""

from __future__ import annotations

from workbench.kernels.e3nn import gate as e3nn_gate
from workbench.kernels.e3nn import linear as e3nn_linear
from workbench.kernels.e3nn import scalar_tp as e3nn_scalar_tp
from workbench.kernels.e3nn import silu, spherical_harmonics
from workbench.kernels.nequip import edge_vectors, radial

COMPANIONS = (
    edge_vectors.SWAP,
    radial.SWAP,
    silu.SWAP,
    e3nn_linear.SWAP,
    e3nn_gate.SWAP,
    e3nn_scalar_tp.SWAP,
    spherical_harmonics.SWAP,
)
