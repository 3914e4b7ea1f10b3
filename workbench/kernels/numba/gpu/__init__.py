"""numba-CUDA kernels (``gpu``: a package named ``...numba.cuda`` would be taken by numba-cuda's import redirector): table-driven and unrolled, one launch per pass, and the CUDA target."""
