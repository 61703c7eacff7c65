"""Quantized checkpoints kept quantized in memory.

scheme.py (QuantScheme: a checkpoint's quantization as the engine reads it),
methods.py (config.json's quantization_config per quant_method, and the one-line
refusals of formats the engine does not run), compressed.py (compressed-tensors
configs), checkpoint.py (CheckpointTensors: lazy safetensors access by name),
formats.py (each on-disk layout converted to the in-memory W8/W4 layouts of
engine/kernels/quant_reference.py), online.py (fp8/int8 quantization at load),
load.py (the model read without transformers' quantizer, and the quantized_linears
preparation step), linear.py (QuantizedLinear and its kernel dispatch), experts.py and
mxfp4.py (quantized MoE experts).
"""
