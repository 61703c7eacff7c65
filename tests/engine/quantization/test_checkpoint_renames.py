"""Checkpoints whose keys transformers renames at load (its conversion mapping):
Mixtral's ``block_sparse_moe`` (router ``gate``, experts ``w1``/``w3``/``w2``), which the
model holds under ``mlp``. Every tensor, quantized or not, is read under the model's name."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from shardline import LLM, SamplingParams
from shardline.engine.quantization.checkpoint import CheckpointTensors
from shardline.engine.quantization.experts import QuantizedExperts
from shardline.engine.quantization.linear import QuantizedLinear
from shardline.engine.quantization.load import ignored
from shardline.engine.quantization.scheme import QuantScheme

from . import checkpoints as ckpt
from .moe_checkpoints import fused_reference_model, tiny_moe, write_quantized_experts

PROMPTS = [[5, 9, 33, 70, 100, 7, 8, 200], [6, 10, 34, 71, 101, 7, 8, 200], [300, 12, 45]]
NEW_TOKENS = 12
FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [8, 8]}


def _greedy_hf(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),  # pyright: ignore[reportCallIssue]
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_fp8_mixtral_through_the_engine_matches_transformers(tmp_path) -> None:
    """Attention linears and experts FP8 blocks; the router (``block_sparse_moe.gate``),
    norms and embeddings float, all stored under Mixtral's checkpoint names."""
    float_dir = tiny_moe(tmp_path / "float", "mixtral")
    attention_dir, out_dir = tmp_path / "attention", tmp_path / "fp8"
    dequantized = ckpt.write_quantized(float_dir, attention_dir, FP8_BLOCKS, ckpt.fp8_blocks((8, 8)))
    dequantized |= write_quantized_experts(attention_dir, out_dir, FP8_BLOCKS, ckpt.fp8_blocks((8, 8)))
    stored = CheckpointTensors(out_dir).names()
    assert "model.layers.0.block_sparse_moe.gate.weight" in stored
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv" in stored
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in stored
    expected = [_greedy_hf(fused_reference_model(float_dir, dequantized), prompt) for prompt in PROMPTS]
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # the tokens depend on the input
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert [_greedy_hf(hf, prompt) for prompt in PROMPTS] == expected  # transformers' own FP8 loader agrees

    llm = LLM(str(out_dir), dtype="float32", max_num_seqs=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    model = llm.llm_engine.model  # pyright: ignore[reportAttributeAccessIssue]
    assert sum(isinstance(module, QuantizedExperts) for module in model.modules()) == 2
    assert sum(isinstance(module, QuantizedLinear) and module.layout == "w8" for module in model.modules()) >= 8


def test_renamed_tensors_are_read_under_the_model_names(tmp_path: Path) -> None:
    save_file({"a.block_sparse_moe.gate.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    tensors = CheckpointTensors(tmp_path)
    tensors.rename(lambda name: name.replace(".block_sparse_moe.", ".mlp."))
    assert tensors.names() == {"a.mlp.gate.weight", "b.weight"}
    assert tensors.stored_name("a.mlp.gate.weight") == "a.block_sparse_moe.gate.weight"
    assert tensors.shape("a.mlp.gate.weight") == (2, 3) and tensors.dtype("b.weight") == torch.float32
    torch.testing.assert_close(tensors.get("a.mlp.gate.weight"), torch.arange(6.0).reshape(2, 3))
    assert "a.block_sparse_moe.gate.weight" not in tensors
    # Module paths as the checkpoint stores them, for its ignore list.
    assert tensors.stored_module("a.mlp.gate") == "a.block_sparse_moe.gate"
    assert tensors.stored_module("a.mlp") == "a.block_sparse_moe" and tensors.stored_module("b") == "b"


def test_ignore_lists_name_modules_by_their_stored_names(tmp_path: Path) -> None:
    save_file({"model.layers.0.block_sparse_moe.gate.weight": torch.ones(2, 3)}, str(tmp_path / "model.safetensors"))
    tensors = CheckpointTensors(tmp_path)
    tensors.rename(lambda name: name.replace(".block_sparse_moe.", ".mlp."))
    scheme = QuantScheme("compressed-tensors", "int8", "w8", ignore=("re:.*block_sparse_moe\\.gate$",))
    assert ignored(scheme, tensors, "model.layers.0.mlp.gate")
    assert not ignored(scheme, tensors, "model.layers.0.mlp.up")
