import os

# e3nn 0.4.4 needs this under torch >= 2.6; workbench sets it on import, but tests may import mace first.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
