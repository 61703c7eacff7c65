"""Mamba-2 mixers (mamba2, nemotron_h, bamba, zamba2, falcon_h1, granitemoehybrid).

All six Hugging Face mixers share one shape: in_proj -> [gate z | xBC | dt], a
depthwise causal conv over xBC, the SSD scan per head, a gated RMS norm (or, for
falcon_h1 without it, x * silu(z)) and out_proj. falcon_h1 adds its input multiplier
and per-section mup vector on the projection.

Per request and layer the state is the conv window (the last K-1 pre-conv xBC inputs,
in the model's dtype) and the SSM state [H, P, N] (float32, as Hugging Face keeps it).

The Hugging Face module clamps dt to its time_step_limit in its chunked scan but not
in its one-token update, so under generate a prompt's tokens (run by the scan) take dt
clamped and each generated token (run alone) dt unclamped. The engine follows that by
position, whatever path it runs a token by: a prompt token's dt is clamped, a generated
token's is not, so chunked prefill (a prompt's last token alone in a step) and
recompute after preemption give generate's tokens. A request's single token that
continues a state takes the recurrent update, any other chunk the chunked scan; each
request takes its own branch in one call. On CUDA the single-token updates run as one
Triton launch (kernels/selective_scan.py); on the CPU, where the engine takes the
recurrent kernel, a float32 mixer's single-token updates run as one C call, and every
mixer's convolution through C too (kernels/cpu_recurrent.py).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.cpu_recurrent import decode_kernel_available
from ..kernels.cpu_recurrent import ssd_decode_step as native_ssd_decode_step
from ..kernels.selective_scan import ssd_decode_packed
from .base import RecurrentKind, StateShapes, projection_weight, register_kind
from .conv_varlen import causal_conv1d_varlen
from .decode_split import scan_split
from .ssd import softplus_dt, ssd_chunk_scan_varlen, ssd_decode_step

MAX_CHUNK = 64  # tokens per scan chunk (see _scan)


class Mamba2Module(Protocol):
    """What the kind reads of the transformers mixers registered for it (below);
    projections and norms typed as any module (LoRA wraps them). falcon_h1's
    ``ssm_in_multiplier`` and ``mup_vector`` and a mixer's ``mamba_rms_norm`` switch
    are read where present."""

    in_proj: nn.Module
    out_proj: nn.Module
    norm: nn.Module
    conv1d: nn.Conv1d  # depthwise, weight [conv_dim, 1, K]
    activation: str
    dt_bias: torch.Tensor  # [H]
    A_log: torch.Tensor  # [H]
    D: torch.Tensor  # [H]
    time_step_limit: tuple[float, float]
    intermediate_size: int
    conv_kernel_size: int
    conv_dim: int
    num_heads: int
    head_dim: int
    n_groups: int
    ssm_state_size: int
    chunk_size: int


class Mamba2Kind(RecurrentKind):
    """The SSD mixer of Mamba-2 and the hybrids built on it."""

    name = "mamba2"
    # The convolution (and float32 decode tokens' state updates) run through the CPU
    # kernel where it takes the step's tensors, once chosen.
    has_native_core = True
    reference_dtype = torch.float32  # HF's scan and update run in float32 whatever the model's dtype
    reads_prompt_tokens = True  # forward takes num_prompt_tokens (dt is clamped at prompt positions only)

    def decode_differs_from_scan(self, hf_module: torch.nn.Module) -> bool:
        """Whether the module's one-token update (dt unclamped) may compute a token otherwise
        than its chunked scan (dt clamped to time_step_limit), as the load check needs to know."""
        return tuple(cast(Mamba2Module, hf_module).time_step_limit) != (0.0, float("inf"))

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(Mamba2Module, hf_module)
        dtype = projection_weight(m.in_proj).dtype
        return {
            "conv": ((m.conv_kernel_size - 1, m.conv_dim), dtype),
            "ssm": ((m.num_heads, m.head_dim, m.ssm_state_size), torch.float32),
        }

    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
        num_prompt_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["conv"]: [B, K-1, conv_dim]; states["ssm"]: [B, H, P, N];
        # num_prompt_tokens: [B], how many of each request's tokens are prompt tokens (None: by branch)
        m = cast(Mamba2Module, hf_module)
        dtype = hidden_states.dtype
        ssm_in_multiplier = getattr(m, "ssm_in_multiplier", None)  # falcon_h1
        if ssm_in_multiplier is not None:
            hidden_states = hidden_states * ssm_in_multiplier
        projected = m.in_proj(hidden_states)
        mup_vector = getattr(m, "mup_vector", None)  # falcon_h1
        if mup_vector is not None:
            projected = projected * mup_vector[0]
        gate, xBC, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        xBC = causal_conv1d_varlen(
            xBC, m.conv1d.weight.squeeze(1), m.conv1d.bias, cu_seqlens, has_initial_state, states["conv"],
            m.activation, native=self.native_core,
        )
        group_width = m.n_groups * m.ssm_state_size
        x, B, C = xBC.split([m.intermediate_size, group_width, group_width], dim=-1)
        x = x.reshape(-1, m.num_heads, m.head_dim)
        B = B.reshape(-1, m.n_groups, m.ssm_state_size)
        C = C.reshape(-1, m.n_groups, m.ssm_state_size)
        dt = softplus_dt(dt, m.dt_bias)
        A = -torch.exp(m.A_log.float())

        y = self._scan(m, x, dt, A, B, C, cu_seqlens, has_initial_state, states["ssm"], num_prompt_tokens,
                       native=self.native_core)
        y = y.reshape(-1, m.intermediate_size)
        if getattr(m, "mamba_rms_norm", True):
            y = m.norm(y[None], gate[None])[0]
        else:
            y = y * F.silu(gate)
        return m.out_proj(y.to(dtype))

    @staticmethod
    def _scan(m, x, dt, A, B, C, cu_seqlens, has_initial_state, ssm_state, num_prompt_tokens=None,
              native: bool = False) -> torch.Tensor:
        """Each request's SSM over its tokens: decode steps by the recurrent update, the
        rest by the chunked scan. dt is clamped at prompt tokens and not at generated ones
        (without ``num_prompt_tokens``: clamped in the scan only, as the HF module's own
        branches do). ``native``: a float32 mixer's update through the CPU kernel
        (kernels/cpu_recurrent.py). Returns y [T, H, P]."""
        dt_clamped = torch.clamp(dt, min=m.time_step_limit[0], max=m.time_step_limit[1])
        if num_prompt_tokens is not None:
            dt = dt_clamped = torch.where(prompt_token_mask(cu_seqlens, num_prompt_tokens, dt.shape[0])[:, None],
                                          dt_clamped, dt)
        on_triton = x.is_cuda and triton_available() and x.dtype in KERNEL_DTYPES
        on_cpu_kernel = (native and x.device.type == "cpu" and x.dtype == ssm_state.dtype == torch.float32
                         and decode_kernel_available(x.dtype))
        update = ssd_decode_packed if on_triton else native_ssd_decode_step if on_cpu_kernel else ssd_decode_step

        def decode(state, x, dt, dt_clamped, B, C):
            return update(state, x, dt, A, B, C, m.D)

        # The scan is exact for any chunk size; past 64 its [chunks, H, Q, Q] decay masks
        # cost memory (HF's 256 would hold 16x more per token) for no gain.
        chunk_size = min(m.chunk_size, MAX_CHUNK)

        def chunk(initial, cu, x, dt, dt_clamped, B, C):
            return ssd_chunk_scan_varlen(x, dt_clamped, A, B, C, m.D, chunk_size, cu, initial)

        return scan_split(cu_seqlens, has_initial_state, ssm_state, (x, dt, dt_clamped, B, C), decode, chunk)


def prompt_token_mask(cu_seqlens: torch.Tensor, num_prompt_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] bool: whether each packed token is one of the first ``num_prompt_tokens[b]``
    tokens of its request b (cu_seqlens [B+1])."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = torch.arange(num_tokens, device=cu_seqlens.device) - torch.repeat_interleave(
        cu_seqlens[:-1], lengths, output_size=num_tokens)
    return offsets < torch.repeat_interleave(num_prompt_tokens, lengths, output_size=num_tokens)


MAMBA2 = register_kind(
    Mamba2Kind(),
    module_classes=(
        "Mamba2Mixer",
        "NemotronHMamba2Mixer",
        "BambaMixer",
        "Zamba2MambaMixer",
        "FalconH1Mixer",
        "GraniteMoeHybridMambaLayer",
    ),
    model_types=("mamba2", "nemotron_h", "bamba", "zamba2", "falcon_h1", "granitemoehybrid"),
    layer_types=("linear_attention", "hybrid"),
)
