"""The detokenizer's shortcuts give exactly the text of its plain algorithm.

A plain token's piece is emitted without decoding (TokenizerDecoding.pieces), and a
sample whose text nothing reads per step is detokenized at its finish in one pass
(IncrementalDetokenizer.add_tokens). Both are checked against the algorithm with the
shortcut off, token by token, over random ids: special tokens, added tokens that are
not special, byte tokens that are invalid UTF-8 alone, on a byte-level BPE and on a
SentencePiece-style (Metaspace, byte fallback) tokenizer, with special tokens
skipped or kept, spaced or not.
"""

from __future__ import annotations

import random

import pytest
import transformers

from shardline import SamplingParams
from shardline.engine.sampling.detokenizer import IncrementalDetokenizer, TokenizerDecoding

CORPUS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Résumé naïve café straße 東京 北京 こんにちは 안녕하세요 Привет мир مرحبا",
    "emoji 🙂🚀✨ and the replacement character \ufffd inside a word: a\ufffdb",
    "def main(): return {\"id\": 1, \"prompt\": \"hello\"}  # code with  double  spaces",
]
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>"]


def byte_level_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with special tokens and one added token that is not special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", additional_special_tokens=["<|user|>"])
    fast.add_tokens(["<tool>"])  # added, not special: decoded outside the byte-level decoder
    return fast


def metaspace_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: Metaspace pre-tokenizer, byte fallback, and the
    decoder that strips the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS + byte_tokens, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", additional_special_tokens=["<|user|>"])


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request) -> transformers.PreTrainedTokenizerFast:
    return byte_level_tokenizer() if request.param == "byte_level" else metaspace_tokenizer()


def random_ids(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Stretches of encoded text (multi-byte characters across tokens) mixed with
    uniformly random ids (special tokens, lone bytes)."""
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.5:
            text = rng.choice(CORPUS)
            start = rng.randrange(len(text))
            ids += tokenizer(text[start : start + rng.randint(1, 20)], add_special_tokens=False).input_ids
        else:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
    return ids[:length]


def without_shortcut(tokenizer) -> TokenizerDecoding:
    decoding = TokenizerDecoding(tokenizer)
    decoding.pieces = None
    return decoding


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_shortcuts_give_the_plain_algorithms_text(tokenizer, skip_special_tokens, spaces_between_special_tokens):
    rng = random.Random(7)
    decoding, reference_decoding = TokenizerDecoding(tokenizer), without_shortcut(tokenizer)
    options = (skip_special_tokens, spaces_between_special_tokens)
    for _ in range(150):
        prompt = random_ids(rng, tokenizer, rng.randint(0, 8))
        output = random_ids(rng, tokenizer, rng.randint(1, 40))
        reference = IncrementalDetokenizer(tokenizer, prompt, *options, decoding=reference_decoding)
        per_step = IncrementalDetokenizer(tokenizer, prompt, *options, decoding=decoding)
        at_finish = IncrementalDetokenizer(tokenizer, prompt, *options, decoding=decoding)
        assert [per_step.add_token(t) for t in output] == [reference.add_token(t) for t in output]
        at_finish.add_tokens(output)
        assert at_finish.text == per_step.text == reference.text
        assert at_finish.flush() == per_step.flush() == reference.flush()
        assert at_finish.text == reference.text


def test_plain_pieces_concatenate_and_exclude_what_would_not(tokenizer):
    backend = tokenizer.backend_tokenizer
    pieces = TokenizerDecoding(tokenizer).pieces
    if type(backend.decoder).__name__ != "ByteLevel":
        assert pieces is None  # a decoder that strips or joins: every step decodes
        return
    added = set(backend.get_added_tokens_decoder())
    assert all(pieces[t] is None for t in added)
    assert pieces[tokenizer.convert_tokens_to_ids("é")] is None  # the lone byte 0xE9, not UTF-8 alone
    plain = [t for t, piece in enumerate(pieces) if piece is not None]
    assert "\ufffd" in tokenizer.decode(tokenizer("\ufffd").input_ids)
    assert not any("\ufffd" in pieces[t] for t in plain)
    rng = random.Random(3)
    for _ in range(200):
        window = [rng.choice(plain) for _ in range(rng.randint(1, 6))]
        assert backend.decode(window, rng.random() < 0.5) == "".join(pieces[t] for t in window)


def test_text_made_at_finish_equals_text_made_per_step(tiny_llm):
    """A stop string that never matches makes the engine detokenize every step."""
    prompts = [f"detokenize {i} 東京 🙂" for i in range(12)]
    for skip in (True, False):
        common = dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, skip_special_tokens=skip)
        at_finish = tiny_llm.generate(prompts, SamplingParams(**common), use_tqdm=False)
        per_step = tiny_llm.generate(prompts, SamplingParams(stop=["\x00never"], **common), use_tqdm=False)
        for made_at_finish, made_per_step in zip(at_finish, per_step):
            assert made_at_finish.outputs[0].token_ids == made_per_step.outputs[0].token_ids
            assert made_at_finish.outputs[0].text == made_per_step.outputs[0].text
