"""numba CPU kernels: vector programs over channel vectors, fused row passes, radial tables."""
