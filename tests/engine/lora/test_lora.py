"""LoRA: PEFT adapters applied per token in one packed batch equal the merged models.

References are Hugging Face models in float64 with each adapter merged by peft
(merge_and_unload). Packed batches run through transformers' eager attention with a
block-diagonal causal mask, so the LoRA layers are tested on exactly the packed
[1, T, hidden] layout the engine's runner feeds them. A packed batch is compared
with the merged model on the same packed batch: transformers' eager attention takes
its softmax in float32, whose rounding depends on the row length, so a packed and
a lone sequence differ by ~1e-6 in float64 logits, whatever the adapter.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.lora.adapter import ADAPTER_CONFIG
from shardline.engine.lora.manager import LoRAManager
from shardline.engine.lora.request import LoRAError, LoRARequest, lora_cache_salt, resolve_lora_request
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import hf_greedy, load_hf_model, random_prompts

ATOL = 1e-9  # float64 logits of size ~10: far above rounding, far below any real difference


def make_adapter(base_dir: str, out_dir: Path, seed: int, **lora_options) -> str:
    """Save a PEFT LoRA adapter for ``base_dir`` with random A and B (so it matters)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**lora_options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def merged_model(base_dir: str, adapter_dir: str) -> transformers.PreTrainedModel:
    return peft.PeftModel.from_pretrained(load_hf_model(base_dir), adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def packed_logits(model: torch.nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len_i, V] of each sequence, all run as one packed sequence [1, T]."""
    token_ids = torch.tensor([[t for seq in sequences for t in seq]])
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])[None]
    segment = torch.cat([torch.full((len(seq),), i) for i, seq in enumerate(sequences)])
    causal = torch.arange(len(segment))[:, None] >= torch.arange(len(segment))[None, :]
    allowed = (segment[:, None] == segment[None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    logits = model(token_ids, position_ids=positions, attention_mask=mask[None, None]).logits[0]
    return list(logits.split([len(seq) for seq in sequences]))


@torch.no_grad()
def single_logits(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    return model(torch.tensor([sequence])).logits[0]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "r4": make_adapter(tiny_llama_dir, root / "r4", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"]),
        "r8": make_adapter(tiny_llama_dir, root / "r8", seed=2, r=8, lora_alpha=16, use_rslora=True,
                           target_modules="all-linear"),
        "patterns": make_adapter(tiny_llama_dir, root / "patterns", seed=3, r=4, lora_alpha=4,
                                 target_modules=["q_proj", "o_proj", "up_proj", "down_proj"],
                                 rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 16}),
    }


@pytest.fixture(scope="module")
def merged(tiny_llama_dir, adapters) -> dict[str, transformers.PreTrainedModel]:
    return {name: merged_model(tiny_llama_dir, path) for name, path in adapters.items()}


@pytest.fixture(scope="module")
def requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index, path) for index, (name, path) in enumerate(adapters.items(), start=1)}


def make_manager(model_dir: str, max_loras: int = 2, max_lora_rank: int = 8):
    model = load_hf_model(model_dir)
    return model, LoRAManager(model, max_loras, max_lora_rank, "cpu", torch.float64)


# --------------------------------------------------------------- packed batches
def test_adapters_change_the_model(tiny_llama_dir, merged):
    base = load_hf_model(tiny_llama_dir)
    prompt = random_prompts(1, (12, 12), 512, seed=0)[0]
    for model in merged.values():
        assert (single_logits(model, prompt) - single_logits(base, prompt)).abs().max() > 1.0


def test_packed_batch_with_different_adapters_matches_merged_models(tiny_llama_dir, requests, merged):
    base_model = load_hf_model(tiny_llama_dir)
    model, manager = make_manager(tiny_llama_dir, max_loras=3)
    prompts = random_prompts(5, (3, 17), 512, seed=1)
    names = ["r4", "r8", None, "patterns", "r4"]
    manager.prepare_step([requests[n] if n else None for n in names], [len(p) for p in prompts])
    got = packed_logits(model, prompts)
    base_packed = packed_logits(base_model, prompts)
    for index, (name, logits, base_logits) in enumerate(zip(names, got, base_packed)):
        if name is None:
            assert torch.equal(logits, base_logits)  # no adapter: the base output, bit for bit
        else:
            reference = packed_logits(merged[name], prompts)[index]
            torch.testing.assert_close(logits, reference, rtol=0, atol=ATOL)


def test_wrapped_model_without_active_adapter_is_the_base_model(tiny_llama_dir, requests):
    base_model = load_hf_model(tiny_llama_dir)
    model, manager = make_manager(tiny_llama_dir)
    prompts = random_prompts(3, (4, 9), 512, seed=2)
    expected = packed_logits(base_model, prompts)
    assert all(torch.equal(a, b) for a, b in zip(packed_logits(model, prompts), expected))
    manager.activate(requests["r8"])  # loaded, but no token uses it
    manager.prepare_step([None] * 3, [len(p) for p in prompts])
    assert all(torch.equal(a, b) for a, b in zip(packed_logits(model, prompts), expected))


def test_greedy_tokens_equal_merged_models(tiny_llama_dir, requests, merged):
    """A greedy loop by full re-forward of the packed batch gives each sequence the
    tokens transformers generates with its adapter merged."""
    model, manager = make_manager(tiny_llama_dir)
    base = load_hf_model(tiny_llama_dir)
    names = ["r4", None, "r8"]
    prompts = random_prompts(3, (5, 11), 512, seed=3)
    sequences = [list(p) for p in prompts]
    for _ in range(10):
        manager.prepare_step([requests[n] if n else None for n in names], [len(s) for s in sequences])
        for seq, logits in zip(sequences, packed_logits(model, sequences)):
            seq.append(int(logits[-1].argmax()))
    for name, prompt, seq in zip(names, prompts, sequences):
        reference = merged[name] if name else base
        assert seq[len(prompt):] == hf_greedy(reference, prompt, 10)


def test_gpt2_conv1d_adapter(tmp_path):
    base_dir = str(build_tiny_model(tmp_path / "gpt2", "gpt2"))
    adapter_dir = make_adapter(base_dir, tmp_path / "gpt2-lora", seed=4, r=4, lora_alpha=8,
                               target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    reference = merged_model(base_dir, adapter_dir)
    model, manager = make_manager(base_dir)
    prompts = random_prompts(2, (4, 9), 512, seed=5)
    manager.prepare_step([LoRARequest("g", 1, adapter_dir), None], [len(p) for p in prompts])
    adapted, plain = packed_logits(model, prompts)
    torch.testing.assert_close(adapted, single_logits(reference, prompts[0]), rtol=0, atol=ATOL)
    torch.testing.assert_close(plain, single_logits(load_hf_model(base_dir), prompts[1]), rtol=0, atol=ATOL)


# ------------------------------------------------------------- slots and cache
def test_adapters_load_once_and_evict_least_recently_used(tiny_llama_dir, requests, merged):
    model, manager = make_manager(tiny_llama_dir, max_loras=2)
    r4, r8, patterns = requests["r4"], requests["r8"], requests["patterns"]
    slot_r8 = manager.activate(r8)
    manager.activate(r4)
    assert manager.activate(r8) == slot_r8 and manager.num_loads == 2
    manager.activate(patterns)  # evicts r4, the least recently used
    assert manager.num_loads == 3 and manager.resident_ids == [r8.lora_int_id, patterns.lora_int_id]
    assert manager.slot_of(r4.lora_int_id) is None
    # r4 goes into the slot r8 leaves: r8's weights in layers r4 skips must be gone.
    manager.activate(r4, in_use={patterns.lora_int_id})
    assert manager.slot_of(r4.lora_int_id) == slot_r8 and manager.num_loads == 4
    prompt = random_prompts(1, (9, 9), 512, seed=6)[0]
    manager.prepare_step([r4], [len(prompt)])
    torch.testing.assert_close(packed_logits(model, [prompt])[0], single_logits(merged["r4"], prompt),
                               rtol=0, atol=ATOL)


def test_step_never_evicts_its_own_adapters(tiny_llama_dir, requests):
    _, manager = make_manager(tiny_llama_dir, max_loras=2)
    manager.activate(requests["r4"])
    manager.activate(requests["r8"])
    with pytest.raises(LoRAError, match="in use"):
        manager.activate(requests["patterns"], in_use={requests["r4"].lora_int_id, requests["r8"].lora_int_id})
    with pytest.raises(LoRAError, match="3 distinct.*max_loras=2"):
        manager.prepare_step(list(requests.values()), [1, 1, 1])


def test_same_id_for_another_path_is_rejected(tiny_llama_dir, adapters):
    _, manager = make_manager(tiny_llama_dir)
    manager.check(LoRARequest("a", 1, adapters["r4"]))
    with pytest.raises(LoRAError, match="lora_int_id 1"):
        manager.activate(LoRARequest("b", 1, adapters["r8"]))


def test_token_slots_must_name_loaded_adapters_and_match_the_forward(tiny_llama_dir, requests):
    model, manager = make_manager(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"\[1\]"):
        manager.set_token_slots(torch.tensor([-1, 1, 1]))
    manager.prepare_step([requests["r4"]], [4])
    with pytest.raises(RuntimeError, match="4 tokens.*6"):
        packed_logits(model, [[5, 6, 7, 8, 9, 10]])
    manager.clear_token_slots()
    packed_logits(model, [[5, 6, 7, 8, 9, 10]])


# ---------------------------------------------------------------------- errors
def edited_adapter(source: str, tmp_path: Path, **config_changes) -> str:
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    config = json.loads((target / ADAPTER_CONFIG).read_text())
    config.update(config_changes)
    (target / ADAPTER_CONFIG).write_text(json.dumps(config))
    return str(target)


def test_unknown_path_is_named(tiny_llama_dir, tmp_path):
    _, manager = make_manager(tiny_llama_dir)
    missing = str(tmp_path / "no-such-adapter")
    with pytest.raises(LoRAError, match="no-such-adapter"):
        manager.activate(LoRARequest("x", 1, missing))
    with pytest.raises(LoRAError, match="lora_path ''"):
        manager.check(LoRARequest("x", 2))


def test_directory_without_safetensors_weights(tiny_llama_dir, adapters, tmp_path):
    path = edited_adapter(adapters["r4"], tmp_path)
    Path(path, "adapter_model.safetensors").unlink()
    _, manager = make_manager(tiny_llama_dir)
    with pytest.raises(LoRAError, match="adapter_model.safetensors"):
        manager.check(LoRARequest("x", 1, path))


def test_rank_above_max_lora_rank_names_both(tiny_llama_dir, requests):
    _, manager = make_manager(tiny_llama_dir, max_lora_rank=4)
    with pytest.raises(LoRAError, match="r=8.*max_lora_rank=4"):
        manager.activate(requests["r8"])
    assert manager.num_loads == 0


def test_target_modules_missing_from_the_model_are_named(tiny_llama_dir, adapters, tmp_path):
    path = edited_adapter(adapters["r4"], tmp_path, target_modules=["q_proj", "c_attn"])
    _, manager = make_manager(tiny_llama_dir)
    with pytest.raises(LoRAError, match="'c_attn'"):
        manager.check(LoRARequest("x", 1, path))


def test_adapter_for_another_architecture(tiny_llama_dir, tmp_path):
    gpt2_dir = str(build_tiny_model(tmp_path / "gpt2", "gpt2"))
    adapter = make_adapter(gpt2_dir, tmp_path / "lora", seed=0, r=2, target_modules=["c_attn"])
    _, manager = make_manager(tiny_llama_dir)
    with pytest.raises(LoRAError, match="c_attn"):
        manager.check(LoRARequest("x", 1, adapter))


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "IA3"),
    ({"r": 0}, "r must be a positive integer, got 0"),
])
def test_unsupported_options_are_named(tiny_llama_dir, adapters, tmp_path, change, message):
    path = edited_adapter(adapters["r4"], tmp_path, **change)
    _, manager = make_manager(tiny_llama_dir)
    with pytest.raises(LoRAError, match=message):
        manager.check(LoRARequest("x", 1, path))


def test_lora_error_is_a_value_error():
    assert issubclass(LoRAError, ValueError)


# ------------------------------------------------------------ through LLM.generate
MAX_NEW_TOKENS = 12


def lora_llm(model_dir: str, **options) -> LLM:
    """An LLM with LoRA enabled."""
    return LLM(model_dir, dtype="float64", enable_lora=True, max_num_seqs=8, **options)


@pytest.fixture(scope="module")
def engine_llm(tiny_llama_dir, requests) -> LLM:
    return lora_llm(tiny_llama_dir, max_loras=2, max_lora_rank=8)


def expected_tokens(tiny_llama_dir, merged, names, prompts) -> list[list[int]]:
    base = load_hf_model(tiny_llama_dir)
    return [hf_greedy(merged[n] if n else base, p, MAX_NEW_TOKENS) for n, p in zip(names, prompts)]


def generate_tokens(llm: LLM, requests, names, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=[requests[n] if n else None for n in names])
    return [o.outputs[0].token_ids for o in outputs]


def test_generate_gives_each_request_its_adapters_greedy_tokens(engine_llm, tiny_llama_dir, requests, merged):
    names = ["r4", "r8", None, "r4", None, "r8"]
    prompts = random_prompts(len(names), (2, 40), 512, seed=8)
    expected = expected_tokens(tiny_llama_dir, merged, names, prompts)
    assert generate_tokens(engine_llm, requests, names, prompts) == expected


def test_more_adapters_than_slots_in_one_call(engine_llm, tiny_llama_dir, requests, merged):
    """Three adapters, max_loras=2: the engine never runs more than two at once."""
    names = ["r4", "r8", "patterns", None, "patterns", "r4", "r8"]
    prompts = random_prompts(len(names), (2, 30), 512, seed=9)
    expected = expected_tokens(tiny_llama_dir, merged, names, prompts)
    assert generate_tokens(engine_llm, requests, names, prompts) == expected


def test_prefix_cache_is_not_shared_across_adapters(engine_llm, tiny_llama_dir, requests, merged):
    prompt = random_prompts(1, (70, 70), 512, seed=10)[0]  # several full KV blocks
    for name in [None, "r4", "r8", "r4", None]:
        [tokens] = generate_tokens(engine_llm, requests, [name], [prompt])
        assert tokens == expected_tokens(tiny_llama_dir, merged, [name], [prompt])[0], name


def test_generate_rejects_a_bad_adapter_and_stays_clean(tiny_llama_dir, requests, tmp_path):
    llm = lora_llm(tiny_llama_dir, max_loras=1, max_lora_rank=4)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(LoRAError, match="no-such-adapter"):
        llm.generate(["a", "b"], params, use_tqdm=False,
                     lora_request=[None, LoRARequest("x", 9, str(tmp_path / "no-such-adapter"))])
    with pytest.raises(LoRAError, match="r=8.*max_lora_rank=4"):
        llm.generate("a", params, use_tqdm=False, lora_request=requests["r8"])
    assert not llm.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------ prefix cache salt
def test_cache_salt_separates_adapters():
    assert lora_cache_salt(None) is None
    salts = {lora_cache_salt(LoRARequest("a", i, "/p")) for i in (1, 2)}
    assert len(salts) == 2
    assert repr(lora_cache_salt(LoRARequest("a", 3, "/p"))) == "('lora', 3)"


# ------------------------------------------------------- default per-modality rule
DEFAULTS = {"image": "/loras/image", "audio": "/loras/audio"}


def mm_prompt(*modalities: str) -> dict:
    return {"prompt": "describe", "multi_modal_data": {m: object() for m in modalities}}


def test_modality_default_lora_id_is_alphabetical_index_plus_one():
    assert resolve_lora_request(mm_prompt("image"), None, DEFAULTS) == LoRARequest("image", 2, "/loras/image")
    assert resolve_lora_request(mm_prompt("audio"), None, DEFAULTS) == LoRARequest("audio", 1, "/loras/audio")


def test_prompts_without_a_registered_modality_keep_the_explicit_request():
    explicit = LoRARequest("mine", 7, "/loras/mine")
    assert resolve_lora_request("plain text", explicit, DEFAULTS) is explicit
    assert resolve_lora_request({"prompt": "no media"}, None, DEFAULTS) is None
    assert resolve_lora_request(mm_prompt("video"), explicit, DEFAULTS) is explicit
    assert resolve_lora_request(mm_prompt("image"), explicit, None) is explicit
    assert resolve_lora_request(mm_prompt("image"), None, {}) is None


def test_explicit_request_wins_with_a_warning(caplog):
    explicit = LoRARequest("mine", 7, "/loras/mine")
    with caplog.at_level(logging.WARNING, logger="shardline.engine.lora.request"):
        assert resolve_lora_request(mm_prompt("image"), explicit, DEFAULTS) is explicit
    assert "explicit" in caplog.text
    caplog.clear()
    same_id = LoRARequest("img", 2, "/loras/image")
    with caplog.at_level(logging.WARNING, logger="shardline.engine.lora.request"):
        assert resolve_lora_request(mm_prompt("image"), same_id, DEFAULTS) is same_id
    assert caplog.text == ""


def test_several_matching_modalities_fall_back_with_a_warning(caplog):
    explicit = LoRARequest("mine", 7, "/loras/mine")
    with caplog.at_level(logging.WARNING, logger="shardline.engine.lora.request"):
        assert resolve_lora_request(mm_prompt("image", "audio"), None, DEFAULTS) is None
        assert resolve_lora_request(mm_prompt("image", "audio"), explicit, DEFAULTS) is explicit
    assert caplog.text.count("audio") == 2


def test_adapter_on_a_model_whose_attention_calls_its_original_module(tmp_path):
    """stablelm's attention runs through its original module (ContextForwardingAttention):
    the LoRA layers put in place after the adapters must be the ones that original calls."""
    base_dir = str(build_tiny_model(tmp_path / "stablelm", "stablelm"))
    adapter_dir = make_adapter(base_dir, tmp_path / "stablelm-lora", seed=6, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj", "o_proj"])
    request = LoRARequest("s", 1, adapter_dir)
    prompts = random_prompts(2, (6, 20), 512, seed=9)
    llm = lora_llm(base_dir, max_loras=1, max_lora_rank=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=request)
    reference = merged_model(base_dir, adapter_dir)
    expected = [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]
    assert expected != [hf_greedy(load_hf_model(base_dir), p, MAX_NEW_TOKENS) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
