"""xLSTM's mLSTM layer (transformers' xLSTMLayer) as a recurrent kind.

    q, k, v, o = projections of x;  i, f = soft_cap(gate projections of x)
    h = mLSTM(q, k, v, i, f)                     (per head; engine/kernels/xlstm_mlstm.py)
    y = out_proj(sigmoid(o) * multihead_norm(h))

Per request and layer the state is, per head, the matrix memory C [DQK, DV], its
normaliser n [DQK] and the running maximum m, in the model's dtype (where transformers'
cache keeps them between calls). Each request's scheduled tokens run as transformers
runs a forward call's: whole chunks of ``chunk_size`` chunkwise, the rest token by token
in ``inference_state_dtype`` (float32), for float32 models through the Triton kernel on
CUDA or the C kernel once the CPU paths choose it. transformers' model has mLSTM blocks only (no sLSTM); the block's
norms and feed-forward stay the model's own, around this layer.

``prepare_model`` readies what the model's own forward does around its layers: it
hands the packed step to its layers whole (its memory-bounding split of long inputs
into ``max_inference_chunksize`` pieces would cut the engine's packed batch), and it
takes ``logits_to_keep``, which transformers' xLSTM forward does not, through a hook
that keeps only those rows before the LM head.
"""

from __future__ import annotations

import sys
from typing import Literal, Protocol, cast

import torch
from torch import nn

from ..kernels._triton import triton_available
from ..kernels.cpu_xlstm import mlstm_kernel_available, mlstm_step_loop_cpu
from ..kernels.xlstm_mlstm import StepLoop, mlstm_varlen, step_loop_varlen
from ..kernels.xlstm_mlstm_triton import mlstm_step_loop_triton
from .base import RecurrentKind, StateShapes, register_kind


class MlstmConfig(Protocol):
    """What the kind reads of transformers' xLSTMConfig."""

    num_heads: int
    weight_mode: Literal["single", "fused"]
    gate_soft_cap: float | None
    chunk_size: int
    eps: float
    inference_state_dtype: str


class MlstmLayerModule(Protocol):
    """What the kind reads of transformers' xLSTMLayer (projections typed as any module:
    LoRA and the CPU paths wrap them; ``single`` weights name q..fgate_preact, ``fused``
    ones qkv_opreact and ifgate_preact)."""

    config: MlstmConfig
    qk_dim: int
    v_dim: int
    ogate_act_fn: nn.Module
    multihead_norm: nn.Module
    out_proj: nn.Module


class SingleProjections(Protocol):
    """xLSTMLayer's projections with weight_mode "single"."""

    q: nn.Module
    k: nn.Module
    v: nn.Module
    ogate_preact: nn.Module
    igate_preact: nn.Module
    fgate_preact: nn.Module


class FusedProjections(Protocol):
    """xLSTMLayer's projections with weight_mode "fused"."""

    qkv_opreact: nn.Module
    ifgate_preact: nn.Module


def _soft_cap(values: torch.Tensor, cap: float | None) -> torch.Tensor:
    return values if cap is None else cap * torch.tanh(values / cap)


def _projections(m: MlstmLayerModule, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k, v, o, i, f) of x [T, hidden], as the layer's weight mode computes them."""
    config = m.config
    if config.weight_mode == "fused":
        fused = cast(FusedProjections, m)
        q, k, v, o = torch.tensor_split(fused.qkv_opreact(x), (m.qk_dim, 2 * m.qk_dim, 2 * m.qk_dim + m.v_dim), -1)
        gates = _soft_cap(fused.ifgate_preact(x), config.gate_soft_cap)
        i, f = torch.tensor_split(gates, (config.num_heads,), -1)
        return q, k, v, o, i, f
    single = cast(SingleProjections, m)
    return (single.q(x), single.k(x), single.v(x), single.ogate_preact(x),
            _soft_cap(single.igate_preact(x), config.gate_soft_cap),
            _soft_cap(single.fgate_preact(x), config.gate_soft_cap))


class _KeptRows:
    """The ``logits_to_keep`` of the model forward in progress (None outside one)."""

    def __init__(self) -> None:
        self.keep: int | torch.Tensor | None = None

    def hold(self, module: nn.Module, args, kwargs) -> tuple:
        self.keep = kwargs.pop("logits_to_keep", None)
        return args, kwargs

    def release(self, *unused) -> None:
        self.keep = None

    def slice_rows(self, module: nn.Module, args: tuple) -> tuple:
        # hidden_states: [B, T, hidden] -> the kept rows only
        keep, (hidden_states, *rest) = self.keep, args
        if isinstance(keep, torch.Tensor):
            hidden_states = hidden_states.index_select(1, keep.to(hidden_states.device))
        elif keep:
            hidden_states = hidden_states[:, -keep:]
        return (hidden_states, *rest)


class MlstmLayerKind(RecurrentKind):
    """xLSTMLayer: the mLSTM matrix memory behind its projections and output gate."""

    name = "mlstm"
    # The step loop runs through the C kernel (kernels/cpu_xlstm.c) once the CPU paths
    # choose the recurrent kernel.
    has_native_core = True
    # transformers computes the token-by-token part in inference_state_dtype (float32)
    # in every model dtype.
    reference_dtype = torch.float32
    returns_tuple = True  # xLSTMBlock unpacks (output, state)

    def prepare_model(self, model: nn.Module) -> None:
        for module in model.modules():
            if type(module).__name__ != "xLSTMForCausalLM":
                continue
            config = getattr(module, "config", None)
            if config is not None:
                config.max_inference_chunksize = sys.maxsize  # one call: the engine's step is already bounded
            kept, lm_head = _KeptRows(), getattr(module, "lm_head", None)
            if isinstance(lm_head, nn.Module):
                module.register_forward_pre_hook(kept.hold, with_kwargs=True)
                module.register_forward_hook(kept.release, always_call=True)
                lm_head.register_forward_pre_hook(kept.slice_rows)

    def state_shapes(self, hf_module: nn.Module, hf_config) -> StateShapes:
        m = cast(MlstmLayerModule, hf_module)
        heads = m.config.num_heads
        dtype = next(hf_module.parameters()).dtype
        dqk, dv = m.qk_dim // heads, m.v_dim // heads
        return {"c": ((heads, dqk, dv), dtype), "n": ((heads, dqk), dtype), "m": ((heads,), dtype)}

    def forward(
        self,
        hf_module: nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; c [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH]
        m = cast(MlstmLayerModule, hf_module)
        config, num_tokens = m.config, hidden_states.shape[0]
        q, k, v, o, i, f = _projections(m, hidden_states)
        heads = config.num_heads
        q, k, v = (tensor.reshape(num_tokens, heads, -1) for tensor in (q, k, v))
        state_dtype = getattr(torch, config.inference_state_dtype)
        h = mlstm_varlen(q, k, v, i, f, cu_seqlens, has_initial_state, states["c"], states["n"], states["m"],
                         config.chunk_size, config.eps, state_dtype, self._step_loop(q, state_dtype, states))
        normed = m.multihead_norm(h[None]).reshape(num_tokens, -1)
        return m.out_proj(m.ogate_act_fn(o) * normed)

    def _step_loop(self, q: torch.Tensor, state_dtype: torch.dtype, states: dict[str, torch.Tensor]) -> StepLoop:
        """A kernel's step loop where it computes what the torch one does (float32 inputs
        and state): the Triton kernel on CUDA, the C kernel on the CPU once the CPU paths
        chose it; else the torch loop."""
        float32 = q.dtype == state_dtype == torch.float32 and all(
            state.dtype == torch.float32 and state.is_contiguous() for state in states.values())
        if float32 and q.is_cuda and triton_available():
            return mlstm_step_loop_triton
        if float32 and self.native_core and q.device.type == "cpu" and mlstm_kernel_available():
            return mlstm_step_loop_cpu
        return step_loop_varlen


MLSTM = register_kind(MlstmLayerKind(), module_classes=("xLSTMLayer",), model_types=("xlstm",),
                      layer_types=("recurrent",))
