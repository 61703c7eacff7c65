"""Loaded by pytest before any test module: with no CUDA device, Triton kernels run
through Triton's interpreter on CPU tensors. The variable must be set before triton
is first imported (transformers imports it), hence here at the repository root."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
