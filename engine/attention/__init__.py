"""Attention: transformers' entry point and the per-step context, the backends (Triton,
torch with native CPU kernels), the torch path."""
