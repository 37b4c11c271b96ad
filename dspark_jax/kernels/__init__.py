"""Pallas kernels (Triton lowering on GPU, interpret mode on CPU), each beside its pure-JAX
reference; `dispatch` picks between them (kernel on GPU, reference elsewhere, DSPARK_KERNELS /
`use_kernels` to force either)."""
