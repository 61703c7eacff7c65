"""Structured outputs' cost: the same workload constrained to a small JSON schema and
unconstrained, side by side in one process, at 64 and 256 concurrent requests.

bench_engine's model and prompts (random-weight Llama-shaped model, random-token
prompts), greedy. The constrained run goes first and fixes each request's output
length (its JSON ends it, or max_tokens); the unconstrained run then generates
exactly as many tokens per request (ignore_eos), so the two differ only by the
grammar work: compiling (once, before timing, as a long job amortises it), filling
the batch's token bitmask each step, applying it, and advancing the matchers.

    python bench/bench_structured.py [--concurrency 64 256] [--output-len 128] [--repeat 2]
                                     [--device auto] [--dtype float32]

Rounds are interleaved (constrained, unconstrained) and the best run of each side
is compared, as in bench_engine. Prints output tokens/s of both, their ratio, and
how many constrained outputs parse and validate.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import build_bench_model, random_prompts
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


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    llm.reset_prefix_cache()  # every run computes its prompts
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


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


def bench_concurrency(llm: LLM, concurrency: int, args: argparse.Namespace) -> None:
    prompts = random_prompts(concurrency, args.min_len, args.max_len, 16384, seed=concurrency)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_outputs=SCHEMA_PARAMS)
    _, outputs = run(llm, prompts, [constrained] * concurrency)  # fixes the lengths
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    sides = {"constrained": [constrained] * concurrency, "unconstrained": free}
    speeds: dict[str, list[float]] = {name: [] for name in sides}  # output tokens/s of each run
    for _ in range(args.repeat):
        for name, params in sides.items():
            elapsed, outputs = run(llm, prompts, params)
            # Greedy on a GPU may change a token between runs: each run counts its own.
            speeds[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            if name == "constrained":
                num_valid = sum(validates(o.outputs[0].text) for o in outputs)
    best = {name: max(runs) for name, runs in speeds.items()}
    num_tokens = sum(lengths)
    print(f"{concurrency} concurrent requests, {num_tokens} output tokens "
          f"({num_tokens / concurrency:.1f} per request), {num_valid}/{concurrency} constrained outputs validate")
    for name, runs in speeds.items():
        print(f"  {name:14s} {best[name]:9.1f} output tok/s   runs: {', '.join(f'{s:.1f}' for s in runs)}")
    print(f"  constrained / unconstrained: {best['constrained'] / best['unconstrained']:.3f} "
          f"(best against best; round by round: "
          f"{', '.join(f'{c / f:.3f}' for c, f in zip(speeds['constrained'], speeds['unconstrained']))})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds of both sides; best against best")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()

    llm = LLM(build_bench_model(), dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency))
    llm.generate({"prompt_token_ids": [5] * 16}, SamplingParams(max_tokens=2, structured_outputs=SCHEMA_PARAMS),
                 use_tqdm=False)  # compiles the grammar, warms up
    print(f"workload: random-token prompts of {args.min_len}-{args.max_len} tokens, greedy, max_tokens "
          f"{args.output_len}, {args.dtype} on {llm.llm_engine.device}, {torch.get_num_threads()} threads, "
          f"{args.repeat} interleaved round(s)")
    for concurrency in args.concurrency:
        bench_concurrency(llm, concurrency, args)


if __name__ == "__main__":
    main()
