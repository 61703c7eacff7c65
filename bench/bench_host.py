"""The engine's host work per step, on CPU: what a GPU worker pays besides its forward.

A tiny random-weight Llama-shaped model (hidden 64, 2 layers, float32) with a
real-sized vocabulary (a byte-level BPE tokenizer of 32,000 tokens trained on
random words, so detokenization costs what it does with a real tokenizer) decodes
256 sequences at once (max_num_seqs=256, short prompts, 128 output tokens each,
greedy, ignore_eos). Its forward is nearly free, so what is left of each step is
the host's: scheduling, input building, sampling, output processing and
detokenization, the engine's bookkeeping.

    python bench/bench_host.py [--num-seqs 256] [--output-len 128] [--repeat 3] [--cpu-time]
                               [--cprofile N] [--async-scheduling on|off] [--stop STRING]

Prints, per run: engine steps, total ms per step, ms per step inside the model's
forward (the transformers module's call), host ms per step (total minus forward),
and the host split by phase (scheduling, input building, sampling, the rest:
output processing, detokenization, stop checks, bookkeeping). Each phase is timed
by wrapping the engine function that does it; the wrappers cost about a
microsecond a call.

``--cpu-time`` runs torch on one thread and times by this thread's CPU time
(time.thread_time) instead of the wall clock, which other work on a shared machine
moves less. ``--cprofile N`` profiles one extra run with cProfile and prints its N
most expensive functions by own time. ``--stop STRING`` gives every request that stop
string: its text is then detokenized and searched at every step (without one, a
request's text is made at its finish).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from shardline import LLM, SamplingParams

MODEL_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

clock: Callable[[], float] = time.perf_counter


def build_tokenizer(path: Path, vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens trained on random lowercase words:
    its tokens are multi-character pieces, as a real tokenizer's are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(60000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((" ".join(words[i : i + 100]) for i in range(0, len(words), 100)),
                                  trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                                eos_token="<|eos|>", pad_token="<|pad|>")
    fast.save_pretrained(str(path))
    return fast


def build_model(path: Path, vocab_size: int) -> str:
    tokenizer = build_tokenizer(path, vocab_size)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), **MODEL_CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path))
    return str(path)


class PhaseTimer:
    """Time spent in the engine's phases, by wrapping the functions that do them."""

    PHASES = (
        ("scheduling", "shardline.engine.core.scheduler", "Scheduler", "schedule"),
        ("input building", "shardline.engine.model.runner", "ModelRunner", "prepare_inputs"),
        ("sampling", "shardline.engine.sampling.sampler", "Sampler", "__call__"),
        # Appending sampled tokens, detokenization, stop checks, finished outputs (an
        # engine function of its own only where the engine has one).
        ("output processing", "shardline.engine.llm_engine", "LLMEngine", "_process"),
        # Inside sampling: the argmax (or draw) over the whole vocabulary, device work on a GPU.
        ("token choice", "shardline.engine.sampling.sampler", "Sampler", "_choose_tokens"),
        # Inside output processing: the incremental detokenization of each new token where
        # text is read per step (stop strings), and of a request's tokens at its finish.
        ("detokenization", "shardline.engine.sampling.detokenizer", "IncrementalDetokenizer", "add_token"),
        ("detokenization", "shardline.engine.sampling.output_processor", "OutputProcessor", "_final_text"),
    )

    def __init__(self, llm: LLM) -> None:
        import importlib

        self.seconds: dict[str, float] = {"forward": 0.0}
        for label, module_name, class_name, function_name in self.PHASES:
            owner = getattr(importlib.import_module(module_name), class_name)
            function = getattr(owner, function_name, None)
            if function is None:
                continue
            self.seconds[label] = 0.0
            setattr(owner, function_name, self._timed(label, function))
        model = llm.llm_engine.runner.model
        model.forward = self._timed("forward", model.forward)  # the module's own call, not its hooks

    def _timed(self, label: str, function):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += clock() - start

        return timed

    def reset(self) -> None:
        for label in self.seconds:
            self.seconds[label] = 0.0


def run(llm: LLM, prompts: list[list[int]], output_len: int, stop: list[str] | None = None) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, stop=stop)
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    steps_before = engine.num_steps
    start = clock()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = clock() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed, engine.num_steps - steps_before


def report(name: str, elapsed: float, steps: int, seconds: dict[str, float]) -> tuple[float, float]:
    """Print one run's split; return its host ms per step, with and without the
    sampler's vocabulary-wide token choice."""
    per_step = lambda value: 1000 * value / steps  # noqa: E731
    forward = seconds["forward"]
    host = elapsed - forward
    choice = seconds.get("token choice", 0.0)
    nested = ("forward", "token choice", "detokenization")
    phases = {label: value for label, value in seconds.items() if label not in nested}
    rest = host - sum(phases.values())
    inside = {"sampling": f" (token choice over the vocabulary {per_step(choice):.2f})"}
    split = ", ".join(f"{label} {per_step(value):.2f}{inside.get(label, '')}" for label, value in phases.items())
    detokenization = per_step(seconds.get("detokenization", 0.0))
    print(f"{name}: {steps} steps, total {per_step(elapsed):.2f} ms/step, forward {per_step(forward):.2f}, "
          f"host {per_step(host):.2f} ({split}, the rest {per_step(rest):.2f}; detokenization, in output "
          f"processing or the rest, {detokenization:.2f}); host without the token choice "
          f"{per_step(host - choice):.2f}", flush=True)
    return per_step(host), per_step(host - choice)


def main() -> None:
    global clock
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true",
                        help="one torch thread, timed by this thread's CPU time")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="profile one more run with cProfile; print its N most expensive functions")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default=None,
                        help="the engine's async_scheduling option (default: the engine's own choice)")
    parser.add_argument("--stop", action="append", default=None, metavar="STRING",
                        help="a stop string every request has (repeatable); a run must not meet it")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    model_dir = build_model(Path(tempfile.mkdtemp(prefix="shardline-host-bench-")), args.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab_size) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_seqs)]
    options = dict(max_num_seqs=args.num_seqs, max_model_len=1024)
    if args.async_scheduling is not None:
        options["async_scheduling"] = args.async_scheduling == "on"
    llm = LLM(model_dir, dtype="float32", device="cpu", **options)
    run(llm, prompts[:8], 4)  # warm-up
    timer = PhaseTimer(llm)
    print(f"{args.num_seqs} sequences, prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.output_len} output tokens each, vocabulary {llm.llm_engine.vocab_size}; timed by "
          f"{'thread CPU time, one torch thread' if args.cpu_time else 'wall clock'}; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    host = []
    for index in range(args.repeat):
        timer.reset()
        elapsed, steps = run(llm, prompts, args.output_len, args.stop)
        host.append(report(f"run {index + 1}", elapsed, steps, timer.seconds))
    print(f"host ms/step: best {min(h for h, _ in host):.2f}, worst {max(h for h, _ in host):.2f}; without the "
          f"token choice: best {min(h for _, h in host):.2f}, worst {max(h for _, h in host):.2f}")
    if args.cprofile:
        profiler = cProfile.Profile(clock)  # the runs' own clock
        profiler.enable()
        run(llm, prompts, args.output_len, args.stop)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
