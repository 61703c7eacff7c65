"""Loaded by pytest before any test module. With no CUDA device, Triton kernels run
through Triton's interpreter on CPU tensors. The variable must be set before triton
is first imported (transformers imports it), hence here at the repository root."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine's CPU fast paths are taken wherever the host can run them, without the
# load-time race against their torch alternatives, so every test runs the same paths
# on a given host; tests/engine/cpu/test_cpu_paths.py covers the race and each fallback.
os.environ.setdefault("SHARDLINE_CPU_PATHS", "all=on")
