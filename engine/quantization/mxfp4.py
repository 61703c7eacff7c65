"""MXFP4 experts (gpt-oss): the checkpoint's layout read as it is on disk, and the
experts' weights kept in it.

gpt-oss checkpoints (``quant_method`` "mxfp4") quantize only the experts of each MoE
layer; the attention, the router, the embeddings and the output head stay in the
checkpoint's float dtype (its ``modules_to_not_convert``). Per layer the experts are
``{experts}.gate_up_proj_blocks`` [E, 2I, H // 32, 16] uint8 and ``_scales``
[E, 2I, H // 32] uint8, ``{experts}.down_proj_blocks`` [E, H, I // 32, 16] and
``_scales`` [E, H, I // 32], beside float biases ``gate_up_proj_bias`` [E, 2I] and
``down_proj_bias`` [E, H]. That is engine/kernels/quant_reference.py's MXFP4 layout
with output rows first, so it is held as read. The gate_up rows interleave the two
halves (row 2i gates, row 2i + 1 is up), as the model's clamped SwiGLU reads them.

Invariants:
- The weights stay MXFP4 in memory (uint8 blocks and scales); no float copy of an
  expert's weight is made: engine/kernels/cpu_mxfp4.c decodes it in registers, and
  the torch path (no C compiler, or another device) a tile of rows at a time.
- ``matmul`` returns exactly the float32 product with the reference's dequantized weight
  (``dequantize_mxfp4``), up to the summation order of the float32 matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu_mxfp4 import cpu_mxfp4_available, cpu_mxfp4_matmul
from ..kernels.quant_reference import FP4_E2M1_VALUES, dequantize_mxfp4
from .checkpoint import CheckpointTensors, QuantizedCheckpointError

MXFP4_BLOCK = 32  # elements sharing one E8M0 scale
# Float elements of one dequantized tile: bounds the transient float copy of a weight.
TILE_ELEMENTS = 1 << 20


def _pair_table() -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values of each byte, low nibble first."""
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)


class Mxfp4ExpertWeights(nn.Module):
    """One projection of every expert in MXFP4: ``blocks`` [E, N, K // 32, 16] uint8,
    ``scales`` [E, N, K // 32] uint8 (engine/kernels/quant_reference.py's layout).
    ``matmul`` multiplies tokens by one expert's weight, dequantizing it a tile of
    output rows at a time."""

    blocks: torch.Tensor
    scales: torch.Tensor
    pair_values: torch.Tensor
    exponents: torch.Tensor

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
        assert blocks.dim() == 4 and blocks.shape[-1] == MXFP4_BLOCK // 2, blocks.shape
        assert tuple(scales.shape) == tuple(blocks.shape[:-1]), (scales.shape, blocks.shape)
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("scales", scales.contiguous())
        # Lookup tables (a few KiB): the value pair of each byte, 2^(s - 127) of each scale.
        self.register_buffer("pair_values", _pair_table().to(blocks.device), persistent=False)
        self.register_buffer("exponents", torch.exp2(torch.arange(256, dtype=torch.float32, device=blocks.device)
                                                     - 127.0), persistent=False)
        # Set by the load check's dequantized_reference (engine/quantization/linear.py).
        self.use_reference = False
        # The CPU path (engine/cpu/paths.py's quant_kernels): the C kernel, else tile_matmul.
        self.cpu_kernels = True

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * MXFP4_BLOCK

    def dequantize_rows(self, expert: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of expert ``expert``'s weight, float32 [stop - start, K]."""
        blocks = self.blocks[expert, start:stop]  # [R, K // 32, 16]
        values = self.pair_values[blocks.int()].flatten(-2)  # [R, K // 32, 32]
        scales = self.exponents[self.scales[expert, start:stop].int()].unsqueeze(-1)
        return (values * scales).flatten(-2)

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] times expert ``expert``'s weight transposed: float32 [T, N], by the C
        kernel on the CPU where it builds, else a tile of dequantized rows at a time;
        with ``use_reference`` set, x times the reference's whole dequantized weight."""
        if self.use_reference:
            return x.float() @ dequantize_mxfp4(self.blocks[expert], self.scales[expert]).t()
        if x.device.type == "cpu" and self.cpu_kernels and cpu_mxfp4_available():
            activations = x if x.dtype == torch.bfloat16 else x.float()
            return cpu_mxfp4_matmul(activations.contiguous(), self.blocks[expert], self.scales[expert], self.exponents)
        return self.tile_matmul(expert, x)

    def tile_matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``matmul`` through torch: a tile of output rows dequantized at a time."""
        x32 = x.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        rows_per_tile = max(1, TILE_ELEMENTS // self.in_features)
        for start in range(0, self.out_features, rows_per_tile):
            stop = min(start + rows_per_tile, self.out_features)
            torch.matmul(x32, self.dequantize_rows(expert, start, stop).t(), out=out[:, start:stop])
        return out

    def dequantize(self) -> torch.Tensor:
        """Every expert's float32 weight [E, N, K], through the reference (for checks)."""
        return dequantize_mxfp4(self.blocks, self.scales)


def _require(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` if it has ``dtype`` and ``shape``; QuantizedCheckpointError naming the tensor otherwise."""
    if tensor.dtype != dtype:
        raise QuantizedCheckpointError(f"MXFP4 tensor {name} is {tensor.dtype}; expected {dtype}")
    if tuple(tensor.shape) != shape:
        raise QuantizedCheckpointError(f"MXFP4 tensor {name} has shape {tuple(tensor.shape)}; expected {shape}")
    return tensor


def read_mxfp4_projection(tensors: CheckpointTensors, name: str, out_features: int, in_features: int,
                          num_experts: int) -> Mxfp4ExpertWeights:
    """The MXFP4 projection ``{name}_blocks`` / ``{name}_scales`` of ``num_experts``
    experts mapping ``in_features`` to ``out_features``; QuantizedCheckpointError naming the
    tensor whose dtype or shape is not that (``in_features`` not a multiple of 32 too)."""
    if in_features % MXFP4_BLOCK:
        raise QuantizedCheckpointError(f"MXFP4 projection {name}: its input width {in_features} is not a multiple "
                             f"of the {MXFP4_BLOCK}-element block")
    groups = in_features // MXFP4_BLOCK
    blocks = _require(f"{name}_blocks", tensors.get(f"{name}_blocks", "MXFP4 expert weights"), torch.uint8,
                      (num_experts, out_features, groups, MXFP4_BLOCK // 2))
    scales = _require(f"{name}_scales", tensors.get(f"{name}_scales", "MXFP4 expert scales"), torch.uint8,
                      (num_experts, out_features, groups))
    return Mxfp4ExpertWeights(blocks, scales)


def read_float_bias(tensors: CheckpointTensors, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """A float bias [E, N] of the experts, held in float32 (transformers' own MXFP4
    experts hold theirs so too)."""
    bias = tensors.get(name, "the experts' bias")
    if not bias.dtype.is_floating_point or bias.element_size() < 2:
        raise QuantizedCheckpointError(f"MXFP4 experts' bias {name} is {bias.dtype}; expected a 16- or 32-bit float")
    if tuple(bias.shape) != shape:
        raise QuantizedCheckpointError(f"MXFP4 experts' bias {name} has shape {tuple(bias.shape)}; expected {shape}")
    return bias.float()

