"""The small_linear_kernel CPU path: packed linears run the row counts that race faster
on the small-batch C kernel on it (raced as a step reads the weights), over oneDNN's
own packed copy, and the engine's greedy tokens stay transformers'. Off, every fallback
test of test_cpu_paths.py runs."""

import json

import pytest
import torch
import transformers

from shardline.engine.cpu import linear_race
from shardline.engine.cpu.layers import FusedDecoderLayer
from shardline.engine.cpu.linear import (
    KERNEL_ROW_COUNTS,
    FusedGatedMLP,
    KernelPacked,
    PackedLinear,
    pack_weight,
    packed_matmul,
)
from shardline.engine.kernels.cpu_small_linear import small_linear, small_linear_available

from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(not (small_linear_available(torch.float32) and torch.backends.mkldnn.is_available()),
                                reason="needs a C compiler and oneDNN")
PROMPTS = [[5, 6, 7], list(range(3, 60)), [(7 * i) % 200 + 3 for i in range(90)]]


def _packed_weights(model: torch.nn.Module) -> list[object]:
    found = []
    for module in model.modules():
        if isinstance(module, PackedLinear):
            found.append(module.packed_weight)
        elif isinstance(module, FusedGatedMLP):
            found.append(module.packed_gate_up)
        elif isinstance(module, FusedDecoderLayer) and module.packed_qkv is not None:
            found.append(module.packed_qkv)
    return found


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from shardline import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, pad_token_id=2)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


@taken_unless_forced_off("packed_linears", "small_linear_kernel")
def test_turned_on_every_packed_linear_takes_the_kernel_and_tokens_stay(tiny_llama_dir, monkeypatch):
    from shardline import LLM

    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "packed_linears=on,small_linear_kernel=on")
    monkeypatch.setattr(linear_race, "TAKE_RATIO", 0.0)  # every raced row count taken,
    monkeypatch.setattr(linear_race, "ARITHMETIC_TAKE_RATIO", 0.0)  # the larger ones too
    expected = _hf_greedy(tiny_llama_dir, PROMPTS)
    assert expected != _hf_greedy(tiny_llama_dir, [p[1:] + [9] for p in PROMPTS])  # the input matters
    llm = LLM(tiny_llama_dir, dtype="float32")
    assert llm.llm_engine.cpu_paths.small_linear_kernel
    packed = _packed_weights(llm.llm_engine.model)
    assert packed and all(isinstance(weight, KernelPacked) for weight in packed)
    assert _greedy(llm, PROMPTS) == expected
    llm.close()
    llm = LLM(tiny_llama_dir, dtype="bfloat16")  # the load check passes on the bfloat16 kernel
    assert any(isinstance(weight, KernelPacked) for weight in _packed_weights(llm.llm_engine.model))
    assert all(len(tokens) == 8 for tokens in _greedy(llm, PROMPTS))
    llm.close()


def test_each_shape_is_raced_once_and_the_cached_ratio_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    choose = linear_race.small_kernel_choice(rows_hint=64, forced=False, step_bytes=1 << 16)
    choose(48, 32, torch.float32)
    cache = tmp_path / "cpu_paths.json"
    measured = json.loads(cache.read_text())  # one ratio per raced row count: up to 8 at least
    raced = KERNEL_ROW_COUNTS.index(linear_race.ARITHMETIC_ROWS) + 1
    assert raced <= len(measured) <= len(KERNEL_ROW_COUNTS) and all(ratio >= 0 for ratio in measured.values())
    choose(48, 32, torch.float32)
    assert json.loads(cache.read_text()) == measured  # cached: not raced again
    cache.write_text(json.dumps({key: 0.5 for key in measured}))
    assert choose(48, 32, torch.float32) == frozenset()
    assert len(json.loads(cache.read_text())) == len(measured)  # stopped where the kernel lost at 8 rows
    cache.write_text(json.dumps({key: 2.0 for key in measured}))
    assert choose(48, 32, torch.float32) >= frozenset(KERNEL_ROW_COUNTS[:len(measured)])
    before = len(json.loads(cache.read_text()))
    choose(48, 40, torch.float32)  # another shape races on its own
    assert len(json.loads(cache.read_text())) >= before + raced
    linear_race.small_kernel_choice(rows_hint=64, forced=False, step_bytes=1 << 18)(48, 40, torch.float32)
    assert len(json.loads(cache.read_text())) >= before + 2 * raced  # and over more copies on its own
    assert linear_race.small_kernel_choice(rows_hint=64, forced=True)(48, 40, torch.float32) == frozenset(
        KERNEL_ROW_COUNTS)


def test_row_counts_past_the_first_arithmetic_bound_loss_are_not_raced():
    asked = []

    def speedup_at(rows: int) -> float:
        asked.append(rows)
        return {1: 1.5, 2: 1.0, 4: 1.3, 8: 1.25, 16: 0.9}.get(rows, 3.0)

    assert linear_race.rows_taken(speedup_at) == frozenset({1, 4, 8})
    assert asked == [1, 2, 4, 8, 16]
    assert linear_race.rows_taken(lambda rows: 0.5 if rows < 8 else 1.5) == frozenset(KERNEL_ROW_COUNTS[3:])


def test_the_race_reads_as_many_weight_bytes_as_a_step():
    """A weight is raced over copies filling the model's linear weights (capped), so it
    is read from where a step reads it: memory for a model past the cache."""
    weight_bytes = 48 * 32 * 4
    assert linear_race.raced_copies(48, 32, torch.float32, 0) == 1
    assert linear_race.raced_copies(48, 32, torch.float32, 10 * weight_bytes + 5) == 10
    assert linear_race.raced_copies(48, 32, torch.float32, 1 << 40) == linear_race.RACED_BYTES // weight_bytes
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    assert linear_race.linear_weight_bytes(model, torch.bfloat16) == (32 * 48 + 48 * 16) * 2
    weights = linear_race.RacedWeights.build(48, 32, torch.float32, 64, copies=3)
    if weights is None:
        pytest.skip("the kernel does not read oneDNN's layout on this host")
    assert len({copy.data_ptr() for copy in weights.kernel}) == 3  # three copies in memory, each its own
    x = torch.randn(5, 32)
    outputs = [packed_matmul(x, packed, None) for packed in weights.onednn]
    for packed, view in zip(weights.onednn, weights.kernel):
        assert view.storage is packed
        torch.testing.assert_close(small_linear(x, view, None), outputs[0], rtol=1e-5, atol=1e-4)
    assert weights.speedup(2) > 0


@pytest.mark.parametrize("rows", [3, 40, KERNEL_ROW_COUNTS[-1] + 5])
def test_packed_matmul_takes_the_kernel_at_its_row_counts_and_gives_the_product(rows):
    """Row counts up to 4 through the kernel here, others through oneDNN; either way
    the float32 product."""
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    packed = pack_weight(weight, 64, lambda *_: frozenset({1, 2, 4}))
    if not isinstance(packed, KernelPacked):
        pytest.skip("the kernel does not read oneDNN's layout on this host")
    assert packed.takes(rows) == (rows <= 4)
    x = torch.randn(rows, 24, generator=generator)
    torch.testing.assert_close(packed_matmul(x, packed, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)


def test_taken_by_default_where_the_host_runs_it(monkeypatch):
    """Without settings the path is taken wherever packed linears are and the kernel
    builds; which row counts it runs is the race's per shape."""
    from shardline.engine.cpu.capability import ModelShape
    from shardline.engine.cpu.paths import choose_cpu_paths

    # The other measured paths set, so that nothing but this choice is decided here.
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "packed_linears=on,prefill_kernel=off,quant_kernels=off,"
                                              "quant_int8_kernel=off")
    shape = ModelShape(hidden_size=64, widest_linear=192, num_heads=4, num_kv_heads=2, head_dim=16)
    paths = choose_cpu_paths(torch.float32, shape, rows_hint=64)
    capable, why = linear_race.small_linear_capability(torch.float32)
    assert paths.small_linear_kernel == (capable and paths.packed_linears)
    assert dict(paths.reasons)["small_linear_kernel"] == (
        why if paths.small_linear_kernel or not capable else "it runs packed linears, which are not taken")
