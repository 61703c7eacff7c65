"""The race between the two decode tiles of int8 weights times one row of bfloat16 x
(kernels/cpu_quant_digits.h's integer byte products, and the bfloat16 dot-product
tiles): measured once per host and shape, cached, the digit products taken only where
measured MARGIN faster, and the choice given to each quantized linear of an engine's
bfloat16 model, whose decode calls pass it to the kernel."""

import json

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.cpu import paths as cpu_paths
from shardline.engine.cpu.capability import ModelShape
from shardline.engine.cpu.measurement import entry_name
from shardline.engine.cpu.paths import choose_cpu_paths
from shardline.engine.kernels.cpu_quant import cpu_w8_linear, digit_tiles_ready
from shardline.engine.kernels.quant_reference import dequantize_w8, quantized_linear_reference
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.quantization.linear import QuantizedLinear, decode_call

pytestmark = pytest.mark.skipif(not digit_tiles_ready(),
                                reason="no digit products here (cpu_quant_bf16.c with AVX512_BF16 and AVX512_VNNI)")

SHAPE = ModelShape(hidden_size=64, widest_linear=192, num_heads=4, num_kv_heads=2, head_dim=16)


def test_both_tiles_give_the_reference():
    """One row of x times an int8 weight through either tile: the float32 reference's
    sums up to float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (100, 200), dtype=torch.int8, generator=generator)
    scale = torch.rand(100, 1, generator=generator) * 1e-2 + 1e-3
    x = torch.randn(1, 200, generator=generator).bfloat16()
    expected = quantized_linear_reference(x.float(), dequantize_w8(weight, scale)).float()
    for digits in (True, False):
        torch.testing.assert_close(cpu_w8_linear(x, weight, scale, digits=digits).float(), expected, rtol=8e-3,
                                   atol=1e-3)


def test_the_race_is_cached_and_decides(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDLINE_CPU_PATHS", raising=False)
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    cpu_paths._host_key.cache_clear()
    try:
        paths = choose_cpu_paths(torch.bfloat16, SHAPE, rows_hint=64)
        assert dict(paths.reasons)["quant_digits_kernel"].startswith("measured ")
        cache = tmp_path / "cpu_paths.json"
        measured = json.loads(cache.read_text())
        digits = entry_name("quant_digits_kernel", (torch.bfloat16, SHAPE, 64))
        kernels = entry_name("quant_kernels", (torch.bfloat16, SHAPE, 64))
        assert digits in measured and kernels in measured
        # Faster digits, but the C kernels not taken at all: nothing to run them in.
        cache.write_text(json.dumps({key: (0.5 if key == kernels else 2.0) for key in measured}))
        without = choose_cpu_paths(torch.bfloat16, SHAPE, rows_hint=64)
        assert not without.quant_kernels and not without.quant_digits_kernel
        assert dict(without.reasons)["quant_digits_kernel"] == (
            "it runs in the quantized linears' C kernels, which are not taken")
        cache.write_text(json.dumps({key: (0.5 if key == digits else 2.0) for key in measured}))
        digits_slower = choose_cpu_paths(torch.bfloat16, SHAPE, rows_hint=64)
        assert digits_slower.quant_kernels and not digits_slower.quant_digits_kernel
        assert dict(digits_slower.reasons)["quant_digits_kernel"] == "measured 0.50x the bfloat16 dot-product tiles"
        # The digit products are the alternative: as fast is not enough, MARGIN faster is.
        cache.write_text(json.dumps({key: (1.0 if key == digits else 2.0) for key in measured}))
        assert not choose_cpu_paths(torch.bfloat16, SHAPE, rows_hint=64).quant_digits_kernel
        cache.write_text(json.dumps({key: 2.0 for key in measured}))
        assert choose_cpu_paths(torch.bfloat16, SHAPE, rows_hint=64).quant_digits_kernel
    finally:
        cpu_paths._host_key.cache_clear()


@pytest.mark.parametrize("setting", ["off", "on"])
def test_an_engine_gives_its_linears_the_choice(tiny_llama_dir, monkeypatch, setting):
    """Every quantized linear of the engine's model holds the choice, and its bound
    decode call was made with it (a call bound before the choice changed is rebound)."""
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"quant_kernels=on,quant_digits_kernel={setting}")
    llm = LLM(tiny_llama_dir, dtype="bfloat16", quantization="int8")
    try:
        engine = llm.llm_engine
        assert isinstance(engine, LLMEngine)
        layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
        assert layers and all(layer.digit_tiles == (setting == "on") for layer in layers)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        for layer in layers:  # the call each would make now (one bound at the probes is made again)
            call = decode_call(layer, torch.randn(1, layer.in_features).bfloat16())
            assert call is not None and call.source[-1] is (setting == "on")
        first = layers[0]
        first.digit_tiles = not first.digit_tiles
        first(torch.randn(1, first.in_features).bfloat16())
        assert first.bound_decode is not None and first.bound_decode.source[-1] is first.digit_tiles
    finally:
        llm.close()
