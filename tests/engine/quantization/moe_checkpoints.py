"""Tiny MoE checkpoints for the quantized-experts tests: gpt-oss with MXFP4 experts in
its exact on-disk layout (engine/model/tiny.py's random model, weights ~N(0, 0.2),
scaled by powers of two per 32-element block so the scales vary, quantized here);
a float Qwen3-MoE whose per-expert linears checkpoints.py's writers quantize; and the
float reference model with per-expert dequantized weights fused as transformers holds them."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from shardline.engine.kernels.quant_reference import FP4_E2M1_VALUES
from shardline.engine.model.tiny import build_tiny_model

# gpt-oss's own list of what its checkpoints leave unquantized.
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (blocks [..., N, K // 32, 16] uint8, scales [..., N, K // 32]
    uint8): OCP MX scaling (shared exponent floor(log2(amax)) - 2), values rounded to
    the nearest E2M1 value, lower index in the low nibble."""
    *lead, rows, cols = weight.shape
    groups = weight.float().reshape(*lead, rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = codes + 8 * ((scaled < 0) & (codes > 0)).long()
    pairs = codes.to(torch.uint8).reshape(*lead, rows, cols // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def _varied(weight: torch.Tensor, generator: torch.Generator, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` [..., N, K] times a power of two (1/8 .. 4) drawn per (bn, bk) block."""
    *lead, rows, cols = weight.shape
    grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    factors = torch.exp2(torch.randint(-3, 3, grid, generator=generator).float())
    factors = factors.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return weight * factors


def _set_quantization_config(path: Path, quantization_config: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))


def write_gpt_oss_mxfp4(path: str | Path, seed: int = 0, intermediate_size: int = 64) -> Path:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 (``_blocks``/``_scales`` [E, N, K // 32, ...]
    with the float biases) and the rest float32, with gpt-oss's quantization_config."""
    path = build_tiny_model(path, "gpt_oss", seed=seed, head_dim=16, sliding_window=8, num_local_experts=4,
                            num_experts_per_tok=2, intermediate_size=intermediate_size)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers holds them [E, K, N]; the checkpoint stores [E, N, K].
            blocks, scales = quantize_mxfp4(_varied(tensor.transpose(1, 2), generator, (1, 32)))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _set_quantization_config(path, {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED})
    return path


def tiny_qwen3_moe(path: str | Path, seed: int = 0) -> Path:
    """A tiny float32 Qwen3-MoE checkpoint; its experts stored per expert
    (``mlp.experts.{e}.gate_proj.weight`` ...), as transformers saves them."""
    return build_tiny_model(path, "qwen3_moe", seed=seed, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True)


def tiny_moe(path: str | Path, model_type: str, seed: int = 0) -> Path:
    """A tiny float32 MoE checkpoint of ``model_type`` ("mixtral" or "deepseek_v3",
    sizes as tests/engine/coverage.py shrinks them), experts stored per expert."""
    sizes: dict[str, dict] = {
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": dict(head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                            num_key_value_heads=4)}
    return build_tiny_model(path, model_type, seed=seed, **sizes[model_type])


def write_quantized_experts(float_dir: str | Path, out_dir: str | Path, quantization_config: dict,
                            quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
                            ) -> dict[str, torch.Tensor]:
    """Copy ``float_dir`` to ``out_dir`` with every expert's linears (``...experts.{e}.<name>.weight``,
    whatever ``<name>``) replaced by ``quantize(module, weight)``'s tensors; return the
    dequantized weights by module (checkpoints.py's write_quantized covers ``*_proj`` names only)."""
    float_dir, out_dir = Path(float_dir), Path(out_dir)
    shutil.copytree(float_dir, out_dir, dirs_exist_ok=True)
    state = load_file(str(float_dir / "model.safetensors"))
    dequantized = {}
    for name in [name for name in state if re.search(r"\.experts\.\d+\.\w+\.weight$", name)]:
        module = name.removesuffix(".weight")
        tensors, dequantized[module] = quantize(module, state.pop(name).float())
        state.update({f"{module}.{part}": tensor.contiguous() for part, tensor in tensors.items()})
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(out_dir, quantization_config)
    return dequantized


# A per-expert checkpoint linear's part of the fused experts weights, by its name.
FUSED_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fused_reference_model(float_dir: str | Path, dequantized: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """The float32 model of ``float_dir`` with ``dequantized`` weights (by linear module
    name, as the checkpoint stores them) in place: per-expert ``gate_proj``/``up_proj``
    into the fused ``gate_up_proj``'s halves, ``down_proj`` into ``down_proj``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in dequantized.items():
            fused = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)", name)
            if fused is None:
                model.get_parameter(f"{name}.weight").copy_(weight)
                continue
            # Mixtral's checkpoints keep its experts under block_sparse_moe; transformers under mlp.
            experts = fused.group(1).replace(".block_sparse_moe.", ".mlp.")
            expert, part = int(fused.group(2)), FUSED_PART[fused.group(3)]
            if part == "down":
                model.get_parameter(f"{experts}.down_proj")[expert].copy_(weight)
            else:
                rows = weight.shape[0]
                start = 0 if part == "gate" else rows
                model.get_parameter(f"{experts}.gate_up_proj")[expert, start:start + rows].copy_(weight)
    return model
