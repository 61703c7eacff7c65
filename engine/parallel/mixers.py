"""Recurrent mixers split by channels over tensor-parallel ranks, beside the gated
delta-net and Mamba kinds of engine/parallel/recurrent.py.

- LFM2's short convolution (lfm2, lfm2_moe, lfm3): every channel is its own causal
  convolution of B*x, gated by C, so a rank keeps its share of the channels: in_proj's
  rows of them in each of B, C and x, the convolution's, and out_proj's columns
  (row-parallel). Its state (the last inputs of its channels) shrinks with them.
- RWKV-4's block: the WKV recurrence keeps a numerator, denominator and maximum per
  channel of the time mix, so a rank keeps its share of those channels: key, value and
  receptance rows, time_decay and time_first, and output's columns (row-parallel).
  The channel mix is an MLP: key's rows and value's columns (row-parallel); its
  receptance, which gates the summed output, and both token shifts (over the hidden
  size) stay whole.

- Kimi delta attention (kimi_linear, bailing_hybrid): every head keeps its own state
  [K, V] and its own decay per key channel, so a rank keeps its share of the heads:
  q/k/v_proj rows and their convolution channels, b_proj's rows, the forget gate's
  head rows (f_b_proj or f_proj, dt_bias, A_log), the output gate's rows (g_b_proj,
  whose low-rank g_a_proj stays whole, or g_proj), and o_proj's columns
  (row-parallel). The output norm is per head (over head_dim) and stays whole.

- MiniMax's lightning attention: every head keeps its own state [D, D] and decay
  (slope_rate and the decay tables built from it), so a rank keeps its share of the
  heads: qkv_proj's rows of them (laid out per head as q|k|v), output_gate's rows and
  out_proj's columns (row-parallel). Its RMS norm runs over all heads' channels, so it
  becomes a SpanningRMSNorm: each rank's sum of squares summed over ranks.

- RecurrentGemma's recurrent block: the RG-LRU's gates are block-diagonal per head and
  its recurrence per channel, so a rank keeps its share of the heads with their
  channels: linear_x's and linear_y's rows, the convolution's channels, the gates'
  blocks and biases, recurrent_param, and linear_out's columns (row-parallel).

- xLSTM's mLSTM layer: every head keeps its own matrix memory, normaliser and maximum,
  and its norm is per head, so a rank keeps its share of the heads: the q, k, v and
  output-gate rows of them and their input and forget gates (separate projections,
  weight_mode "single"; fused ones run whole), the norm's weights, and out_proj's columns (row-parallel). Its head
  count is read from the model's config, so the layer (and its backend) gets a copy
  of the config with the rank's count.

- Zamba's Mamba mixer: its channels form heads, each with its own x_proj and dt_proj
  weights (so its dt, B and C), so a rank keeps its share of the heads: in_proj's rows
  of their channels (x and gate interleaved per channel), the convolution's channels,
  the heads' x_proj, dt_proj, A_log and D, and out_proj's columns (row-parallel).

Invariants: as engine/parallel/recurrent.py's (a mixer split whole or not at all; its
output summed over ranks by its row-parallel projections).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .group import RankGroup
from .layers import SpanningRMSNorm, column_share, row_share
from .mixers_base import Parts, RunWhole, depthwise_conv, int_of, module_of, ranges, share, sliced, tensor_of

KDA = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention")
LIGHTNING = ("MiniMaxLightningAttention",)
RG_LRU = ("RecurrentGemmaRecurrentBlock",)
MLSTM = ("xLSTMLayer",)
ZAMBA_MAMBA = ("ZambaMambaMixer",)
# The lightning attention's per-head buffers.
LIGHTNING_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
SHORT_CONV = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
RWKV = ("RwkvBlock",)


def short_conv_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of an LFM2 short convolution (module docstring); no size
    attribute changes (its kind reads the convolution's width)."""
    conv = module_of(module, "conv")
    width = tensor_of(conv, "weight").shape[0]
    first, count = share(width, group, "channels")
    projection = module_of(module, "in_proj")
    if getattr(projection, "out_features", None) != 3 * width:
        raise RunWhole("its input projection has rows beside B, C and x")
    rows = ranges((first, count), (width + first, count), (2 * width + first, count))
    parts: Parts = {"in_proj": column_share(projection, f"{name}.in_proj", rows, group),
                    "conv": depthwise_conv(conv, ranges((first, count))),
                    "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    return parts, {}


def rwkv_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of an RWKV block (module docstring): replaced inside its time
    mix (``attention``) and channel mix (``feed_forward``) modules, so the returned parts
    are named by their path under the block."""
    attention, feed_forward = module_of(module, "attention"), module_of(module, "feed_forward")
    width = tensor_of(attention, "time_decay").shape[0]
    first, count = share(width, group, "time-mix channels")
    channels = ranges((first, count))
    parts: Parts = {}
    for attribute in ("key", "value", "receptance"):
        parts[f"attention.{attribute}"] = column_share(module_of(attention, attribute), f"{name}.attention.{attribute}",
                                                       channels, group)
    for attribute in ("time_decay", "time_first"):
        parts[f"attention.{attribute}"] = sliced(tensor_of(attention, attribute), channels)
    parts["attention.output"] = row_share(module_of(attention, "output"), f"{name}.attention.output", group)
    key = module_of(feed_forward, "key")
    inner = getattr(key, "out_features", None)
    if not isinstance(inner, int):
        raise RunWhole("its channel mix's key is not a linear")
    first, count = share(inner, group, "channel-mix channels")
    parts["feed_forward.key"] = column_share(key, f"{name}.feed_forward.key", ranges((first, count)), group)
    parts["feed_forward.value"] = row_share(module_of(feed_forward, "value"), f"{name}.feed_forward.value", group)
    return parts, {}


def kda_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a Kimi delta attention mixer and its sizes (module docstring;
    dotted sizes are its forget gate's)."""
    num_heads, head_dim = int_of(module, "num_heads"), int_of(module, "head_dim")
    first, count = share(num_heads, group, "heads")
    width, qkv_dim = count * head_dim, num_heads * head_dim
    rows, heads = ranges((first * head_dim, width)), ranges((first, count))
    channels = torch.cat([rows, rows + qkv_dim, rows + 2 * qkv_dim])
    parts: Parts = {attribute: column_share(module_of(module, attribute), f"{name}.{attribute}", rows, group)
                    for attribute in ("q_proj", "k_proj", "v_proj")}
    parts["b_proj"] = column_share(module_of(module, "b_proj"), f"{name}.b_proj", heads, group)
    parts["conv1d"] = depthwise_conv(module_of(module, "conv1d"), channels)
    parts["o_proj"] = row_share(module_of(module, "o_proj"), f"{name}.o_proj", group)
    output_gate = "g_proj" if hasattr(module, "g_proj") else "g_b_proj"
    parts[output_gate] = column_share(module_of(module, output_gate), f"{name}.{output_gate}", rows, group)
    gate = module_of(module, "forget_gate")
    projection = "f_proj" if hasattr(gate, "f_proj") else "f_b_proj"
    parts[f"forget_gate.{projection}"] = column_share(module_of(gate, projection), f"{name}.forget_gate.{projection}",
                                                      rows, group)
    parts["forget_gate.dt_bias"] = sliced(tensor_of(gate, "dt_bias"), rows)
    a_log = tensor_of(gate, "A_log")  # [H] or [1, 1, H, 1]
    if a_log.dim() == 1:
        parts["forget_gate.A_log"] = sliced(a_log, heads)
    elif a_log.dim() == 4 and a_log.shape[2] == num_heads:
        parts["forget_gate.A_log"] = nn.Parameter(a_log.detach()[:, :, first : first + count].contiguous(),
                                                  requires_grad=False)
    else:
        raise RunWhole(f"its forget gate's A_log has shape {tuple(a_log.shape)}")
    sizes = {"num_heads": count, "qkv_dim": width, "conv_dim": 3 * width, "forget_gate.num_heads": count,
             "forget_gate.qkv_dim": width}
    return parts, sizes


def lightning_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a MiniMax lightning attention mixer and its head count
    (module docstring)."""
    num_heads, head_dim = int_of(module, "num_attention_heads"), int_of(module, "head_dim")
    first, count = share(num_heads, group, "heads")
    rows = ranges((first * head_dim, count * head_dim))
    parts: Parts = {
        "qkv_proj": column_share(module_of(module, "qkv_proj"), f"{name}.qkv_proj",
                                 ranges((first * 3 * head_dim, count * 3 * head_dim)), group),
        "output_gate": column_share(module_of(module, "output_gate"), f"{name}.output_gate", rows, group),
        "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    for attribute in LIGHTNING_BUFFERS:  # heads on the first axis longer than 1 ([H, ...] or [1, H, ...])
        buffer = tensor_of(module, attribute)
        axis = next((axis for axis, length in enumerate(buffer.shape) if length != 1), 0)
        if buffer.shape[axis] != num_heads:
            raise RunWhole(f"its {attribute} has shape {tuple(buffer.shape)}, not one entry per head")
        parts[attribute] = buffer.narrow(axis, first, count).contiguous()
    norm = module_of(module, "norm")
    weight = tensor_of(norm, "weight")
    parts["norm"] = SpanningRMSNorm(weight.detach()[rows.to(weight.device)], num_heads * head_dim,
                                    float(getattr(norm, "variance_epsilon", 1e-6)), group)
    return parts, {"num_attention_heads": count}


def rg_lru_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a RecurrentGemma recurrent block and its sizes (module
    docstring; dotted sizes are its RG-LRU's)."""
    rg_lru = module_of(module, "rg_lru")
    num_heads, block_width = int_of(rg_lru, "num_attention_heads"), int_of(rg_lru, "block_width")
    first, count = share(num_heads, group, "RG-LRU heads")
    channels, heads = ranges((first * block_width, count * block_width)), ranges((first, count))
    parts: Parts = {attribute: column_share(module_of(module, attribute), f"{name}.{attribute}", channels, group)
                    for attribute in ("linear_x", "linear_y")}
    parts["conv_1d"] = depthwise_conv(module_of(module, "conv_1d"), channels)
    parts["linear_out"] = row_share(module_of(module, "linear_out"), f"{name}.linear_out", group)
    parts["rg_lru.recurrent_param"] = sliced(tensor_of(rg_lru, "recurrent_param"), channels)
    for attribute in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        parts[f"rg_lru.{attribute}"] = sliced(tensor_of(rg_lru, attribute), heads)
    return parts, {"lru_width": count * block_width, "rg_lru.num_attention_heads": count}


def mlstm_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, object]]:
    """The rank's parts of an xLSTM mLSTM layer and its sizes (module docstring; its
    config and its backend's become a copy with the rank's head count)."""
    config = getattr(module, "config", None)
    if config is None:
        raise RunWhole("it has no config")
    num_heads, qk_dim, v_dim = int_of(config, "num_heads"), int_of(module, "qk_dim"), int_of(module, "v_dim")
    first, count = share(num_heads, group, "heads")
    dqk, dv = qk_dim // num_heads, v_dim // num_heads
    qk_rows, v_rows = ranges((first * dqk, count * dqk)), ranges((first * dv, count * dv))
    heads = ranges((first, count))
    if hasattr(module, "qkv_opreact"):
        raise RunWhole("its projections are fused (weight_mode 'fused'), which is not split")
    rows = {"q": qk_rows, "k": qk_rows, "v": v_rows, "ogate_preact": v_rows, "igate_preact": heads,
            "fgate_preact": heads}
    parts: Parts = {attribute: column_share(module_of(module, attribute), f"{name}.{attribute}", index, group)
                    for attribute, index in rows.items()}
    parts["out_proj"] = row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)
    norm = module_of(module, "multihead_norm")
    for attribute in ("weight", "bias"):
        if isinstance(getattr(norm, attribute, None), torch.Tensor):
            parts[f"multihead_norm.{attribute}"] = sliced(tensor_of(norm, attribute), v_rows)
    local = copy.copy(config)
    local.num_heads = count
    sizes: dict[str, object] = {"qk_dim": count * dqk, "v_dim": count * dv, "config": local,
                                "multihead_norm.num_heads": count, "multihead_norm.num_features": count * dv}
    if isinstance(getattr(module_of(module, "mlstm_backend"), "config", None), type(config)):
        sizes["mlstm_backend.config"] = local
    return parts, sizes


def zamba_mamba_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, object]]:
    """The rank's parts of a Zamba Mamba mixer and its sizes (module docstring)."""
    num_heads, head_dim = int_of(module, "n_mamba_heads"), int_of(module, "mamba_head_dim")
    first, count = share(num_heads, group, "heads")
    channels, heads = ranges((first * head_dim, count * head_dim)), ranges((first, count))
    projection = module_of(module, "in_proj")
    if getattr(projection, "out_features", None) != 2 * num_heads * head_dim:
        raise RunWhole("its input projection has rows beside x and the gate")
    rows = torch.stack([2 * channels, 2 * channels + 1], dim=1).reshape(-1)  # x, gate interleaved per channel
    parts: Parts = {"in_proj": column_share(projection, f"{name}.in_proj", rows, group),
                    "conv1d": depthwise_conv(module_of(module, "conv1d"), channels),
                    "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    for attribute in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
        parts[attribute] = sliced(tensor_of(module, attribute), heads)
    return parts, {"n_mamba_heads": count, "intermediate_size": count * head_dim}
