"""The Allegro model family (nequip-allegro 0.8) for :func:`~workbench.kernels.accelerate`.

Allegro's hot op is its ``Contracter``: a Clebsch-Gordan-sparse bilinear product of per-edge
tensor features with the centre atom's environment, channel by channel, weighted per channel
and path (:mod:`.contracter`), swapped with the same companions as NequIP's (the Bessel
encoding of its two-body embedding, the MLPs' SiLU). :mod:`.adapter` is the family's entry in
the registry. Importing this package needs nequip-allegro (and e3nn >= 0.6), not mace-torch.
"""
