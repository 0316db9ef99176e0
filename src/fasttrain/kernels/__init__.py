"""Hand-written Triton kernels (import a submodule, e.g. ``fasttrain.kernels.norms``)."""
