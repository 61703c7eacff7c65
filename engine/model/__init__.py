"""The model: loading, per-layer cache specs, the runner that builds each step's tensors, the load check, CUDA graphs."""
