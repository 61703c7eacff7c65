"""Structured outputs' cost: the same workload constrained to a small JSON schema and
unconstrained, side by side in one process, at 64 and 256 concurrent requests.

bench_engine's model and prompts (random-weight Llama-shaped model, random-token
prompts), greedy. The constrained run goes first and fixes each request's output
length (its JSON ends it, or max_tokens); the unconstrained run then generates
exactly as many tokens per request (ignore_eos), so the two differ only by the
grammar work: compiling (once, before timing, as a long job amortises it), filling
the batch's token bitmask each step, applying it, and advancing the matchers.

    python bench/bench_structured.py [--concurrency 64 256] [--output-len 128] [--repeat 5]
                                     [--cpu-time] [--device auto] [--dtype float32] [--profile]

Rounds are interleaved, the two sides' order alternating round by round
(constrained first, then unconstrained first, ...), so a load that rises or falls
through a round weighs on both sides alike. Each run is timed by the wall clock and
by a CPU clock: this process's CPU time, or with ``--cpu-time`` (torch on one thread)
the main thread's own CPU time (time.thread_time), which other work sharing the
CPUs barely moves; every grammar call runs on that thread (xgrammar fills the masks
on the calling thread; compiling is done before timing). For each clock it prints
the best run of each side and their ratio, the medians and their ratio, and the
median and range of the round-by-round ratios (each round's two runs saw about the
same load): the figure to trust on a loaded machine is the median round ratio by
``--cpu-time``.

It also prints the seconds the constrained runs spent in each grammar call (mask
filling, bitmask building and application, matcher advances, holding and releasing
rows, the pick check), by the same CPU clock, and how many constrained outputs
parse and validate. ``--profile`` (CPU) splits each side's last run into the
engine's parts (bench_engine's StepProfile), side by side, to show where a
difference between the two sides lies (by the same CPU clock).

``--kernels`` instead times the bitmask application alone, on a [256, 152064]
float32 logits batch (Qwen's vocabulary) whose every other row is constrained,
for three kinds of constrained rows: a JSON value's position (64 tokens allowed),
inside a string (256 tokens forbidden) and random bits (every word mixed, the word-wise
path's worst case). Side by side: on CPU the engine's path (whole forbidden words
filled by torch, the rest by xgrammar's CPU kernel), the same in torch ops alone (the
float64 path), xgrammar's CPU kernel alone and the reference; on CUDA the engine's path (xgrammar's Triton kernel,
the host bitmask's copy included) and the reference. Each path's result is checked
against the reference. Timed by the wall clock, or with ``--cpu-time`` (torch on one
thread) by the main thread's CPU time, on which xgrammar's CPU kernel also runs.

    python bench/bench_structured.py --kernels [--device cpu|cuda] [--repeat 5] [--cpu-time]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import xgrammar
from common import StepProfile, build_bench_model, random_prompts

from shardline import LLM, SamplingParams
from shardline.engine.params import StructuredOutputsParams
from shardline.engine.sampling.structured import apply_token_bitmask, apply_token_bitmask_reference, new_bitmask
from shardline.engine.sampling.structured.bitmask import fill_forbidden_words, mask_mixed_words

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "label": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["id", "label", "score", "tags"],
}
# Compact JSON: a random model let free with whitespace spends its tokens on it.
SCHEMA_PARAMS = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


class GrammarProfile:
    """Seconds (by ``clock``) spent in each of the engine's grammar calls, by wrapping
    its functions (timing only; a wrapper adds about a microsecond per call)."""

    def __init__(self, clock) -> None:
        from shardline.engine import llm_engine
        from shardline.engine.sampling import sampler
        from shardline.engine.sampling.structured import grammar, manager

        self.clock = clock
        self.seconds: dict[str, float] = {}
        wrapped = (
            (grammar.GrammarCompiler, "fill_bitmask", "mask filling (xgrammar)"),
            (manager.StructuredOutputManager, "bitmask", "bitmask building, mask filling included"),
            (sampler, "apply_token_bitmask", "bitmask application"),
            (grammar.GrammarState, "accept", "matcher advances"),
            (manager.StructuredOutputManager, "hold", "holding rows"),
            (manager.StructuredOutputManager, "release", "releasing rows"),
            (llm_engine, "forbidden_picks", "pick check"),
        )
        self.labels = [label for _, _, label in wrapped]
        # Mask filling runs inside bitmask building: only the outer call counts in the total.
        self.nested = {"mask filling (xgrammar)"}
        for owner, name, label in wrapped:
            setattr(owner, name, self._timed(getattr(owner, name), label))

    def _timed(self, function, label: str):
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + self.clock() - start
        return timed

    def total(self) -> float:
        return sum(seconds for label, seconds in self.seconds.items() if label not in self.nested)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], clock) -> tuple[float, float, list]:
    """(wall seconds, CPU seconds by ``clock``, outputs) of one generate call."""
    llm.reset_prefix_cache()  # every run computes its prompts
    start, start_cpu = time.perf_counter(), clock()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, clock() - start_cpu, outputs


def validates(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    import jsonschema

    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


class Rounds:
    """Each side's runs (output tokens/s by each clock), the constrained runs' grammar
    seconds by call, and each side's last run split by engine part."""

    def __init__(self) -> None:
        self.speeds = {clock: {"constrained": [], "unconstrained": []} for clock in ("wall", "cpu")}
        self.grammar: list[dict[str, float]] = []
        self.cpu_seconds: list[float] = []
        self.last_run_parts: dict[str, str] = {}
        self.num_valid = 0


def bench_concurrency(llm: LLM, profile: GrammarProfile, concurrency: int, args: argparse.Namespace,
                      steps: StepProfile | None = None) -> None:
    prompts = random_prompts(concurrency, args.min_len, args.max_len, 16384, seed=concurrency)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_outputs=SCHEMA_PARAMS)
    _, _, outputs = run(llm, prompts, [constrained] * concurrency, profile.clock)  # fixes the lengths
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    sides = [("constrained", [constrained] * concurrency), ("unconstrained", free)]
    rounds = Rounds()
    for round_index in range(args.repeat):
        # The order alternates, so a load rising or falling through the rounds weighs on both sides alike.
        for name, params in sides if round_index % 2 == 0 else sides[::-1]:
            run_side(llm, prompts, name, params, profile, rounds, steps, last=round_index == args.repeat - 1)
    num_tokens = sum(lengths)
    print(f"{concurrency} concurrent requests, {num_tokens} output tokens "
          f"({num_tokens / concurrency:.1f} per request), {rounds.num_valid}/{concurrency} constrained outputs "
          "validate")
    report(rounds, profile, args.cpu_time)


def run_side(llm: LLM, prompts: list[list[int]], name: str, params: list[SamplingParams], profile: GrammarProfile,
             rounds: Rounds, steps: StepProfile | None, last: bool) -> None:
    grammar_before = dict(profile.seconds)
    parts_before = dict(steps.seconds) if steps is not None else {}
    wall, cpu, outputs = run(llm, prompts, params, profile.clock)
    if steps is not None and last:
        last_run = copy.copy(steps)
        last_run.seconds = {label: seconds - parts_before.get(label, 0.0) for label, seconds in steps.seconds.items()}
        rounds.last_run_parts[name] = last_run.report(cpu)
    # Greedy on a GPU may change a token between runs: each run counts its own.
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rounds.speeds["wall"][name].append(num_tokens / wall)
    rounds.speeds["cpu"][name].append(num_tokens / cpu)
    if name == "constrained":
        rounds.num_valid = sum(validates(o.outputs[0].text) for o in outputs)
        rounds.grammar.append({label: seconds - grammar_before.get(label, 0.0)
                               for label, seconds in profile.seconds.items()})
        rounds.cpu_seconds.append(cpu)


def report(rounds: Rounds, profile: GrammarProfile, cpu_time: bool) -> None:
    cpu_name = "main thread's CPU time" if cpu_time else "process CPU time"
    for clock, by_side in rounds.speeds.items():
        clock_name = "wall time" if clock == "wall" else cpu_name
        constrained, free = by_side["constrained"], by_side["unconstrained"]
        for name, runs in by_side.items():
            print(f"  {name:14s} by {clock_name}: best {max(runs):8.1f}, median {median(runs):8.1f} output tok/s"
                  f"   runs: {', '.join(f'{s:.1f}' for s in runs)}")
        per_round = [c / f for c, f in zip(constrained, free)]
        print(f"  constrained / unconstrained by {clock_name}: median round {median(per_round):.3f} "
              f"(rounds {min(per_round):.3f}-{max(per_round):.3f}), best against best "
              f"{max(constrained) / max(free):.3f}, median against median {median(constrained) / median(free):.3f}")
    totals = [sum(s for label, s in g.items() if label not in profile.nested) for g in rounds.grammar]
    print(f"  grammar work in the constrained runs by {cpu_name}: " + ", ".join(
        f"{g:.2f} s of {c:.1f} s ({100 * g / c:.1f}%)" for g, c in zip(totals, rounds.cpu_seconds)))
    for label in profile.labels:
        seconds = [g.get(label, 0.0) for g in rounds.grammar]
        print(f"    {label:42s} median {median(seconds):6.3f} s")
    if rounds.last_run_parts:
        print(f"  last round by part (by {cpu_name}):{'constrained':>14s}   unconstrained")
        for constrained_line, free_line in zip(rounds.last_run_parts["constrained"].splitlines(),
                                               rounds.last_run_parts["unconstrained"].splitlines()):
            print(f"  {constrained_line}   {free_line.split()[-2]:>7s} s")


def kernel_bitmask(kind: str, num_rows: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """A host bitmask whose odd rows are constrained as ``kind`` says, even rows free."""
    bitmask = new_bitmask(num_rows, vocab_size)
    num_constrained = len(range(1, num_rows, 2))
    if kind == "random":
        allowed = torch.rand(num_constrained, vocab_size, generator=generator) < 0.5
    else:
        picked = torch.randint(0, vocab_size, (num_constrained, 64 if kind == "json" else 256), generator=generator)
        allowed = torch.full((num_constrained, vocab_size), kind != "json")
        allowed.scatter_(1, picked, kind == "json")
    bitmask[1::2] = pack_bits(allowed)
    return bitmask


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V / 32)] int32, bit j of word w for token 32 * w + j."""
    num_rows, vocab_size = allowed.shape
    padded = torch.zeros(num_rows, 32 * ((vocab_size + 31) // 32), dtype=torch.int64)
    padded[:, :vocab_size] = allowed
    words = (padded.view(num_rows, -1, 32) << torch.arange(32)).sum(-1)  # [R, W], 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bench_kernels(device: str, repeat: int, clock) -> None:
    """Each path's best and median time by ``clock`` per kind of constrained row."""
    num_rows, vocab_size = 256, 152064
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(num_rows, vocab_size, generator=generator).to(device)
    target = torch.empty_like(base)

    def xgrammar_cpu(bitmask: torch.Tensor) -> torch.Tensor:
        xgrammar.apply_token_bitmask_inplace(target, bitmask, vocab_size=vocab_size, backend="cpu")
        return target

    def torch_words(bitmask: torch.Tensor) -> torch.Tensor:
        mask_mixed_words(target, fill_forbidden_words(target, bitmask))
        return target

    paths = {"reference": lambda bm: apply_token_bitmask_reference(target, bm)}
    if device == "cpu":
        paths["words + xgrammar cpu (engine)"] = lambda bm: apply_token_bitmask(target, bm)
        paths["torch words (float64's)"] = torch_words
        paths["xgrammar cpu kernel alone"] = xgrammar_cpu
    else:
        paths["xgrammar triton (engine)"] = lambda bm: apply_token_bitmask(target, bm)
    print(f"bitmask application on [{num_rows}, {vocab_size}] float32 {device} logits, every other row "
          f"constrained, {torch.get_num_threads()} threads, {repeat} runs each by {clock.__name__} "
          "(ms: best, median)")
    for kind in ("json", "string", "random"):
        bitmask = kernel_bitmask(kind, num_rows, vocab_size, generator)
        expected = apply_token_bitmask_reference(base, bitmask)
        timings = {}
        for name, path in paths.items():
            seconds = []
            for _ in range(repeat):
                target.copy_(base)
                synchronize(device)
                start = clock()
                masked = path(bitmask)
                synchronize(device)
                seconds.append(clock() - start)
            assert torch.equal(masked, expected), (kind, name)
            timings[name] = f"{1e3 * min(seconds):7.2f} {1e3 * median(seconds):7.2f}"
        print(f"  {kind:7s} " + "   ".join(f"{name}: {figures}" for name, figures in timings.items()))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--repeat", type=int, default=5,
                        help="interleaved rounds of both sides, their order alternating")
    parser.add_argument("--cpu-time", action="store_true",
                        help="torch on one thread, runs timed by the main thread's CPU time (for a machine "
                             "other work is loading)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--profile", action="store_true", help="split each side's last run by engine part (CPU)")
    parser.add_argument("--kernels", action="store_true",
                        help="time the bitmask application paths alone (no model), then exit")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    if args.kernels:
        bench_kernels("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                      else "cpu", args.repeat, time.thread_time if args.cpu_time else time.perf_counter)
        return
    clock = time.thread_time if args.cpu_time else time.process_time

    llm = LLM(build_bench_model(), dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency))
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(max_tokens=2, structured_outputs=SCHEMA_PARAMS),
                 use_tqdm=False)  # compiles the grammar, warms up
    print(f"workload: random-token prompts of {args.min_len}-{args.max_len} tokens, greedy, max_tokens "
          f"{args.output_len}, {args.dtype} on {llm.llm_engine.device}, {torch.get_num_threads()} threads, "
          f"{args.repeat} interleaved round(s)")
    profile = GrammarProfile(clock)
    steps = StepProfile(clock) if args.profile else None
    for concurrency in args.concurrency:
        bench_concurrency(llm, profile, concurrency, args, steps)


if __name__ == "__main__":
    main()
