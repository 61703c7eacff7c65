"""Quantized checkpoints kept quantized in memory.

scheme.py (QuantScheme: a checkpoint's quantization as the engine reads it),
methods.py (config.json's quantization_config per quant_method, and the one-line
refusals of formats the engine does not run), compressed.py (compressed-tensors
configs), checkpoint.py (CheckpointTensors: lazy safetensors access by name),
experts.py (quantized MoE experts). The in-memory layouts every format converts to
are written down in engine/kernels/quant_reference.py.
"""
