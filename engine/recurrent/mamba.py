"""Mamba-1 mixers (mamba, falcon_mamba, jamba, zamba).

in_proj -> [x | gate z], a depthwise causal conv over x, x_proj -> [dt low-rank | B | C]
(falcon_mamba and jamba RMS-normalise the three), dt_proj's weight lifts dt to every
channel, then the selective scan with its bias and softplus, and out_proj. zamba
splits the channels into heads, each with its own x_proj and dt_proj, and interleaves
x and z in in_proj's output.

Per request and layer the state is the conv window (the last K-1 pre-conv inputs, in
the model's dtype) and the SSM state [channels, N] (float32 at least, as Hugging Face
keeps it). A request's single token that continues a state takes the float32
recurrent update, as the Hugging Face module's decode branch does; other chunks the
chunked scan (selective_scan.py). On CUDA one Triton kernel (kernels/selective_scan.py)
runs every request, decode or chunk, with its state in float32; on the CPU, where the
engine takes the recurrent kernel, a float32 mixer's decode tokens and every mixer's
convolution run through C (kernels/cpu_recurrent.py).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.cpu_recurrent import decode_kernel_available
from ..kernels.cpu_recurrent import selective_state_update as native_selective_state_update
from ..kernels.selective_scan import selective_scan_packed
from .base import RecurrentKind, StateShapes, projection_weight, register_kind
from .conv_varlen import causal_conv1d_varlen
from .decode_split import scan_split
from .selective_scan import selective_scan_varlen, selective_state_update


class MambaModule(Protocol):
    """What the kind reads of every transformers mixer registered for it (below);
    projections typed as any module (LoRA wraps them). How a mixer makes dt, B and C
    differs by model (``_ssm_inputs``, ``_dt_bias``)."""

    in_proj: nn.Module
    out_proj: nn.Module
    conv1d: nn.Conv1d  # depthwise, weight [Dc, 1, K]
    activation: str
    A_log: torch.Tensor  # [Dc, N]
    D: torch.Tensor  # [Dc]
    intermediate_size: int
    conv_kernel_size: int
    ssm_state_size: int


def _is_zamba(m: object) -> bool:
    return hasattr(m, "x_proj_weight")


def _ssm_inputs(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dt before its bias [T, Dc], B and C [T, G, N] from the conv output x [T, Dc]."""
    rank, state_size = m.time_step_rank, m.ssm_state_size
    if _is_zamba(m):
        heads = m.n_mamba_heads
        params = torch.einsum("hrp,thp->thr", m.x_proj_weight, x.reshape(-1, heads, m.mamba_head_dim))
        time_step, B, C = params.split([rank, state_size, state_size], dim=-1)
        dt = torch.einsum("hpr,thr->thp", m.dt_proj_weight, time_step).reshape(x.shape)
        return dt, B, C
    time_step, B, C = m.x_proj(x).split([rank, state_size, state_size], dim=-1)
    if hasattr(m, "dt_layernorm"):  # falcon_mamba, jamba
        time_step, B, C = m.dt_layernorm(time_step), m.b_layernorm(B), m.c_layernorm(C)
    return time_step @ m.dt_proj.weight.t(), B[:, None], C[:, None]


def _dt_bias(m) -> torch.Tensor | None:
    return m.dt_proj_bias.reshape(-1) if _is_zamba(m) else m.dt_proj.bias


class MambaKind(RecurrentKind):
    """The selective-scan mixer of Mamba-1 and the hybrids built on it."""

    name = "mamba"
    # The convolution (and float32 decode tokens' state updates) run through the CPU
    # kernel where it takes the step's tensors, once chosen.
    has_native_core = True
    reference_dtype = torch.float32  # HF's decode update runs in float32 whatever the model's dtype

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(MambaModule, hf_module)
        dtype = projection_weight(m.in_proj).dtype
        channels = m.intermediate_size
        return {
            "conv": ((m.conv_kernel_size - 1, channels), dtype),
            "ssm": ((channels, m.ssm_state_size), torch.promote_types(dtype, torch.float32)),
        }

    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["conv"]: [B, K-1, Dc]; states["ssm"]: [B, Dc, N]
        m = cast(MambaModule, hf_module)
        dtype = hidden_states.dtype
        projected = m.in_proj(hidden_states)
        if _is_zamba(m):
            x, gate = projected[:, 0::2], projected[:, 1::2]
        else:
            x, gate = projected.chunk(2, dim=-1)
        x = causal_conv1d_varlen(
            x.contiguous(), m.conv1d.weight.squeeze(1), m.conv1d.bias, cu_seqlens, has_initial_state,
            states["conv"], m.activation, native=self.native_core,
        )
        dt, B, C = _ssm_inputs(m, x)
        bias = _dt_bias(m)
        if bias is not None:  # HF rounds the float32 bias to dt's dtype
            dt = dt + bias.float().to(dt.dtype)
        dt = F.softplus(dt)
        A = -torch.exp(m.A_log.float()).reshape(m.intermediate_size, m.ssm_state_size)
        D = m.D.reshape(-1)
        y = self._scan(x, dt, A, B, C, D, gate, cu_seqlens, has_initial_state, states["ssm"], native=self.native_core)
        return m.out_proj(y.to(dtype))

    @staticmethod
    def _scan(x, dt, A, B, C, D, gate, cu_seqlens, has_initial_state, ssm_state, native: bool = False
              ) -> torch.Tensor:
        """Each request's SSM: on CUDA one Triton launch for every request (float32
        state); elsewhere decode steps by the float32 update (``native``: a float32
        mixer's through the CPU kernel, kernels/cpu_recurrent.py), the rest by the
        chunked scan."""
        if x.is_cuda and triton_available() and x.dtype in KERNEL_DTYPES and ssm_state.dtype == torch.float32:
            return selective_scan_packed(x, dt.contiguous(), A.contiguous(), B, C, D.contiguous(), gate,
                                         cu_seqlens, has_initial_state, ssm_state)

        on_cpu_kernel = (native and x.device.type == "cpu" and x.dtype == ssm_state.dtype == torch.float32
                         and D.dtype == torch.float32 and decode_kernel_available(x.dtype))
        update = native_selective_state_update if on_cpu_kernel else selective_state_update

        def decode(state, x, dt, B, C, gate):
            return update(state, x, dt, A, B, C, D, gate)

        def chunk(initial, cu, x, dt, B, C, gate):
            return selective_scan_varlen(x, dt, A, B, C, D.float(), gate, cu, initial)

        return scan_split(cu_seqlens, has_initial_state, ssm_state, (x, dt, B, C, gate), decode, chunk)


MAMBA = register_kind(
    MambaKind(),
    module_classes=("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"),
    model_types=("mamba", "falcon_mamba", "jamba", "zamba"),
    layer_types=("linear_attention", "hybrid"),
)
