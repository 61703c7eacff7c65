"""The fused Llama-family decoder forward (engine/cpu/fused_decoder.py)."""

import shutil

import pytest
import torch
import transformers

from shardline.engine.attention.context import paged_attention_forward
from shardline.engine.cpu.fused_decoder import FusedDecoder, fuse_decoders
from shardline.engine.cpu.layers import FusedDecoderLayer
from shardline.engine.cpu.norms import same_output
from shardline.engine.model.tiny import build_tiny_model

from .fused_models import IDS, llama_with_fused_layers
from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps its torch ops")


def is_fused_layer(layer: torch.nn.Module) -> bool:
    return isinstance(layer, FusedDecoderLayer)


@taken_unless_forced_off("fused_kernels")
def test_the_engine_takes_it_and_every_path_and_weight_keeps_its_name(tmp_path):
    from shardline import LLM, SamplingParams

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    llm = LLM(model_dir, dtype="float32")
    model = llm.llm_engine.model
    assert isinstance(model.model, FusedDecoder)
    assert model.get_decoder() is model.model and model.get_input_embeddings() is model.model.embed_tokens
    names = {f"model.{name}" for name in model.model.original.state_dict()}
    assert names and names <= set(model.state_dict())
    assert model.model.config is model.model.original.config  # the original's attributes read through
    prompt = [5, 6, 7, 8, 9]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  min_new_tokens=8)[0, len(prompt):].tolist()
    llm.close()
    assert list(out) == expected


def test_other_calls_run_the_original_forward_with_parts_replaced_since(tmp_path):
    """A plain transformers call (no engine context) goes to the decoder's own forward,
    which sees a part replaced on the fused decoder afterwards."""
    model, expected = llama_with_fused_layers(tmp_path)
    ids = IDS
    with torch.no_grad():
        original = model.model
        assert fuse_decoders(model, is_fused_layer, same_output) == 1
        assert isinstance(model.model, FusedDecoder) and model.model.original is original
        torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)
        model.model.norm = torch.nn.Identity()
        unnormed = model(ids).logits
    assert original.norm is model.model.norm
    assert not torch.equal(unnormed, expected)


def test_a_decoder_with_a_layer_not_fused_keeps_its_forward(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(build_tiny_model(tmp_path, "llama"))).eval()
    layers = model.model.layers
    layers[0] = FusedDecoderLayer(layers[0], paged_attention_forward, is_last=False, rows_hint=16)
    assert fuse_decoders(model, is_fused_layer, same_output) == 0
    assert not isinstance(model.model, FusedDecoder)


def test_a_decoder_whose_output_differs_on_the_probe_keeps_its_forward(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(build_tiny_model(tmp_path, "llama"))).eval()
    layers = model.model.layers
    for position, layer in enumerate(layers):
        layers[position] = FusedDecoderLayer(layer, paged_attention_forward, is_last=False, rows_hint=16)

    def never_the_same(actual: object, expected: object) -> bool:
        return False

    assert fuse_decoders(model, is_fused_layer, never_the_same) == 0
    assert not isinstance(model.model, FusedDecoder)
