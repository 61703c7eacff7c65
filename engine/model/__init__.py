"""The model: the verdict on whether it can run, loading, per-layer cache specs, the
runner that builds each step's tensors, the load check, attention adapters, CUDA graphs."""
