"""Structured outputs' cost: the same workload constrained to a small JSON schema and
unconstrained, side by side in one process, at 64 and 256 concurrent requests.

bench_engine's model and prompts (random-weight Llama-shaped model, random-token
prompts), greedy. The constrained run goes first and fixes each request's output
length (its JSON ends it, or max_tokens); the unconstrained run then generates
exactly as many tokens per request (ignore_eos), so the two differ only by the
grammar work: compiling (once, before timing, as a long job amortises it), filling
the batch's token bitmask each step, applying it, and advancing the matchers.

    python bench/bench_structured.py [--concurrency 64 256] [--output-len 128] [--repeat 2]
                                     [--device auto] [--dtype float32] [--profile]

Rounds are interleaved (constrained, unconstrained) and the best run of each side
is compared, as in bench_engine. Prints output tokens/s of both by wall time and by
this process's CPU time (steadier when other work shares the CPUs), their ratios,
the seconds the constrained runs spent in grammar work (bitmask filling and
application, matcher advances, holding and releasing rows), and how many
constrained outputs parse and validate. ``--profile`` (CPU) splits each side's
last run into the engine's parts (bench_engine's StepProfile), side by side, to show
where a difference between the two sides lies.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from common import StepProfile, build_bench_model, random_prompts
from shardline import LLM, SamplingParams
from shardline.engine.params import StructuredOutputsParams

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
    """Seconds spent in the engine's grammar work, by wrapping its functions (timing
    only; the wrappers add about a microsecond per call)."""

    def __init__(self) -> None:
        from shardline.engine import llm_engine
        from shardline.engine.sampling import sampler
        from shardline.engine.sampling.structured import grammar, manager

        self.seconds = 0.0
        wrapped = ((manager.StructuredOutputManager, "hold"), (manager.StructuredOutputManager, "release"),
                   (manager.StructuredOutputManager, "bitmask"), (grammar.GrammarState, "accept"),
                   (sampler, "apply_token_bitmask"), (llm_engine, "forbidden_picks"))
        for owner, name in wrapped:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, list]:
    """(wall seconds, this process's CPU seconds, outputs) of one generate call."""
    llm.reset_prefix_cache()  # every run computes its prompts
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, time.process_time() - start_cpu, outputs


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


def bench_concurrency(llm: LLM, profile: GrammarProfile, concurrency: int, args: argparse.Namespace,
                      steps: StepProfile | None = None) -> None:
    prompts = random_prompts(concurrency, args.min_len, args.max_len, 16384, seed=concurrency)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_outputs=SCHEMA_PARAMS)
    _, _, outputs = run(llm, prompts, [constrained] * concurrency)  # fixes the lengths
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    sides = {"constrained": [constrained] * concurrency, "unconstrained": free}
    # Output tokens/s of each run, by wall and by CPU time.
    speeds = {clock: {name: [] for name in sides} for clock in ("wall", "cpu")}
    grammar_seconds, wall_seconds = [], []
    last_run_parts: dict[str, str] = {}  # side -> its last run's StepProfile report
    for round_index in range(args.repeat):
        for name, params in sides.items():
            profiled_before = profile.seconds
            parts_before = dict(steps.seconds) if steps is not None else {}
            wall, cpu, outputs = run(llm, prompts, params)
            if steps is not None and round_index == args.repeat - 1:
                last_run = copy.copy(steps)
                last_run.seconds = {label: seconds - parts_before.get(label, 0.0)
                                    for label, seconds in steps.seconds.items()}
                last_run_parts[name] = last_run.report(wall)
            # Greedy on a GPU may change a token between runs: each run counts its own.
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            speeds["wall"][name].append(num_tokens / wall)
            speeds["cpu"][name].append(num_tokens / cpu)
            if name == "constrained":
                num_valid = sum(validates(o.outputs[0].text) for o in outputs)
                grammar_seconds.append(profile.seconds - profiled_before)
                wall_seconds.append(wall)
    num_tokens = sum(lengths)
    print(f"{concurrency} concurrent requests, {num_tokens} output tokens "
          f"({num_tokens / concurrency:.1f} per request), {num_valid}/{concurrency} constrained outputs validate")
    for clock, by_side in speeds.items():
        best = {name: max(runs) for name, runs in by_side.items()}
        for name, runs in by_side.items():
            print(f"  {name:14s} {best[name]:9.1f} output tok/s by {clock} time   "
                  f"runs: {', '.join(f'{s:.1f}' for s in runs)}")
        print(f"  constrained / unconstrained by {clock} time: {best['constrained'] / best['unconstrained']:.3f} "
              f"(best against best; round by round: "
              f"{', '.join(f'{c / f:.3f}' for c, f in zip(by_side['constrained'], by_side['unconstrained']))})")
    print("  grammar work in the constrained runs: " + ", ".join(
        f"{g:.2f} s of {w:.1f} s ({100 * g / w:.1f}%)" for g, w in zip(grammar_seconds, wall_seconds)))
    if last_run_parts:
        print(f"  last round by part:{'constrained':>25s}   unconstrained")
        for constrained_line, free_line in zip(last_run_parts["constrained"].splitlines(),
                                               last_run_parts["unconstrained"].splitlines()):
            print(f"  {constrained_line}   {free_line.split()[-2]:>7s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds of both sides; best against best")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--profile", action="store_true", help="split each side's last run by engine part (CPU)")
    args = parser.parse_args()

    llm = LLM(build_bench_model(), dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency))
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(max_tokens=2, structured_outputs=SCHEMA_PARAMS),
                 use_tqdm=False)  # compiles the grammar, warms up
    print(f"workload: random-token prompts of {args.min_len}-{args.max_len} tokens, greedy, max_tokens "
          f"{args.output_len}, {args.dtype} on {llm.llm_engine.device}, {torch.get_num_threads()} threads, "
          f"{args.repeat} interleaved round(s)")
    profile = GrammarProfile()
    steps = StepProfile() if args.profile else None
    for concurrency in args.concurrency:
        bench_concurrency(llm, profile, concurrency, args, steps)


if __name__ == "__main__":
    main()
