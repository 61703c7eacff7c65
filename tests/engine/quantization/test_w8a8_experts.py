"""A compressed-tensors INT8 W8A8 Qwen3-MoE checkpoint (every decoder linear, experts
included, int8 per output channel, inputs quantized per token at run time) in its
on-disk layout: the engine's greedy tokens against the checkpoint's own forward.

transformers (5.x) cannot load this checkpoint: its weight conversion, which fuses each
expert's linears into the 3D experts weights, finds none of the int8 expert tensors
under compressed-tensors. The reference is therefore transformers' model with the
dequantized weights in place (its own attention and eager experts code) whose quantized
linears multiply their input as compressed-tensors' forward does: the library's own
dynamic scale and fake quantization, per token (inputs taken as [batch, tokens, K],
as a dense linear sees them; vLLM's W8A8 experts quantize per token likewise). If
transformers learns to load it, its own load is compared as well."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.quantization.experts import LinearsPerExpert, QuantizedExperts
from shardline.engine.quantization.linear import ACTIVATION_QUANTIZED_TOLERANCE, QuantizedLinear

from ..hf_reference import hf_greedy, random_prompts
from . import checkpoints as ckpt
from .moe_checkpoints import fused_reference_model, tiny_qwen3_moe

INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
CONFIG = ckpt.compressed_config(
    "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, INPUTS)
PROMPTS = random_prompts(8, (3, 30), 400, seed=5)
NEW_TOKENS = 8
# Prompts compared token for token: those whose reference greedy path has no two leading
# logits closer than this. Quantizing inputs is discontinuous (test_formats.py's
# W8A8_MARGIN), and in a MoE a flipped code of an expert's input moves the logits
# further than in a dense model: up to the load check's tolerance for such layers.
MOE_MARGIN = ACTIVATION_QUANTIZED_TOLERANCE


@contextmanager
def _linear_inputs_quantized(args: QuantizationArgs) -> Iterator[None]:
    """Within: torch's functional linear multiplies its input fake-quantized per token by
    compressed-tensors (a 2D input [tokens, K] taken as one batch of tokens)."""
    linear = nn.functional.linear

    def quantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        tokens = x if x.dim() > 2 else x.unsqueeze(0)
        scale, zero_point = compute_dynamic_scales_and_zp(value=tokens, args=args, module=nn.Module())
        return linear(fake_quantize(tokens, scale, zero_point, args).view_as(x), weight, bias)

    nn.functional.linear = quantized
    try:
        yield
    finally:
        nn.functional.linear = linear


def _quantizing_inputs(forward: Callable, args: QuantizationArgs) -> Callable:
    def run(*inputs, **options):
        with _linear_inputs_quantized(args):
            return forward(*inputs, **options)
    return run


def w8a8_reference(float_dir: Path, dequantized: dict[str, torch.Tensor],
                   quantize_inputs: bool = True) -> transformers.PreTrainedModel:
    """transformers' model with the dequantized weights; with ``quantize_inputs``, every
    linear the checkpoint quantizes (attention projections, the experts modules) takes
    its input as compressed-tensors quantizes it."""
    model = fused_reference_model(float_dir, dequantized)
    model.set_experts_implementation("eager")  # transformers' per-expert loop over functional linears
    if quantize_inputs:
        args = QuantizationArgs(**INPUTS)
        modules = {name.rsplit(".experts.", 1)[0] + ".experts" if ".experts." in name else name
                   for name in dequantized}
        for name in modules:
            module = model.get_submodule(name)
            module.forward = _quantizing_inputs(module.forward, args)
    return model


def _top_two_gaps(model: transformers.PreTrainedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
    top = logits.topk(2).values
    return top[:, 0] - top[:, 1]


@pytest.fixture(scope="module")
def w8a8_moe(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("w8a8-moe")
    float_dir = tiny_qwen3_moe(root / "float")
    dequantized = ckpt.write_quantized(float_dir, root / "w8a8", CONFIG, ckpt.int8_per_channel)
    assert any(".experts.3.down_proj" in name for name in dequantized)
    return float_dir, root / "w8a8", dequantized


# The CPU kernels forced on (the int8 x int8 kernel where the host has AVX512_VNNI, else
# the weight-only kernels on the dequantized codes), or the torch path.
KERNELS = {"kernels": "quant_kernels=on,quant_int8_kernel=on", "torch": "quant_kernels=off"}


@pytest.fixture(scope="module", params=[
    "kernels", pytest.param("torch", marks=pytest.mark.slow)])
def engine(request, w8a8_moe) -> Iterator[tuple[str, LLM]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDLINE_CPU_PATHS", KERNELS[request.param])
        llm = LLM(str(w8a8_moe[1]), dtype="float32", max_num_seqs=4)
    expert_linears = [linear for module in _engine_experts(llm) for linear in module.modules()
                      if isinstance(linear, QuantizedLinear)]
    assert {linear.cpu_kernels for linear in expert_linears} == {request.param == "kernels"}
    yield request.param, llm


def _engine_experts(llm: LLM) -> list[QuantizedExperts]:
    model = llm.llm_engine.model  # pyright: ignore[reportAttributeAccessIssue]
    return [module for module in model.modules() if isinstance(module, QuantizedExperts)]


def test_w8a8_experts_match_the_checkpoints_forward(w8a8_moe, engine) -> None:
    float_dir, out_dir, dequantized = w8a8_moe
    _, llm = engine
    reference = w8a8_reference(float_dir, dequantized)
    expected = {tuple(prompt): hf_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS}
    assert len(set(map(tuple, expected.values()))) == len(PROMPTS)  # the tokens depend on the input
    # Prompts whose greedy path passes no near-tie (quantizing inputs is discontinuous).
    clear = [prompt for prompt in PROMPTS
             if bool((_top_two_gaps(reference, prompt, expected[tuple(prompt)]) > MOE_MARGIN).all())]
    assert len(clear) >= len(PROMPTS) // 2
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in clear],
                              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == [expected[tuple(p)] for p in clear]

    experts = _engine_experts(llm)
    assert len(experts) == 2
    for module in experts:
        for projection in (module.gate_up, module.down):
            assert isinstance(projection, LinearsPerExpert) and projection.stacked_weight is not None
            assert projection.stacked_weight.dtype == torch.int8
            linears = [linear for linear in projection.modules() if isinstance(linear, QuantizedLinear)]
            assert len(linears) == 4 and {linear.input_quantization for linear in linears} == {"int8"}

    try:  # transformers' own load, where it can
        theirs = ckpt.transformers_own_model(out_dir)
    except (RuntimeError, ValueError, KeyError):
        return
    assert [hf_greedy(theirs, prompt, NEW_TOKENS) for prompt in clear] == [expected[tuple(p)] for p in clear]


def test_each_experts_layer_quantizes_its_inputs_as_the_checkpoint_does(w8a8_moe, engine) -> None:
    """Layer by layer, on hidden states with an outlier channel (so the per-token scale
    is coarse and the input quantization shows): the engine's experts equal the
    reference's, far closer than the weight-only experts come. The torch path computes
    the reference's products exactly; the integer kernel's float32 product differs in
    its last bits, which can move an element of down_proj's input across a rounding
    boundary: one code step of that token's scale."""
    float_dir, _, dequantized = w8a8_moe
    kind, llm = engine
    tolerance = 1e-5 if kind == "torch" else 2e-3
    reference = w8a8_reference(float_dir, dequantized)
    weight_only = w8a8_reference(float_dir, dequantized, quantize_inputs=False)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, reference.config.hidden_size, generator=generator)
    hidden[:, 3] *= 30
    top_k_index = torch.randint(0, 4, (11, 2), generator=generator)
    top_k_weights = torch.rand(11, 2, generator=generator)
    for layer, ours in enumerate(_engine_experts(llm)):
        name = f"model.layers.{layer}.mlp.experts"
        with torch.no_grad():
            expected = reference.get_submodule(name)(hidden, top_k_index, top_k_weights)
            unquantized = weight_only.get_submodule(name)(hidden, top_k_index, top_k_weights)
            actual = ours(hidden, top_k_index, top_k_weights)
        scale = expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale)
        assert (unquantized - expected).abs().max().item() > 5 * tolerance * scale
