"""Synthetic structures for the paper's Table-3 mixture: one builder per chemical family
(:mod:`~workbench.data.synth.generators`, with the water and zeolite builders beside it), the
labels from real calculators (:mod:`~workbench.data.synth.labels`: EMT, TIP3P, GFN-xTB), and the
mixture itself (:func:`~workbench.data.synth.mixture.make_mixture`), which ``workbench data make``
writes as the embedded dataset."""
