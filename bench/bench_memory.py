"""Peak resident memory of a generate run against the number of prompts.

Prompts are streamed from a generator (render one, add one), so the engine holds
at most a few batches of requests at once; what grows with the prompt count is
only the list of outputs. Each size runs in a fresh subprocess and reports its
peak RSS (ru_maxrss), next to the bytes its outputs hold.

    python bench/bench_memory.py [--base 200] [--factor 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, random, resource, sys, sys as _s
from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
num_prompts, model_dir = int(sys.argv[1]), sys.argv[2]
llm = LLM(model_dir, dtype="float32", max_num_seqs=32)
rng = random.Random(0)
prompts = ({"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(16, 128))]}
           for _ in range(num_prompts))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
output_bytes = sum(_s.getsizeof(o.outputs[0].text) + 28 * len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"prompts": num_prompts, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_before_mb": before / 1024, "output_mb": output_bytes / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=200)
    parser.add_argument("--factor", type=int, default=10)
    args = parser.parse_args()
    from shardline.engine.model.tiny import build_tiny_model

    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="shardline-mem-"), "llama"))
    results = []
    for num_prompts in (args.base, args.base * args.factor):
        out = subprocess.run([sys.executable, "-c", CHILD, str(num_prompts), model_dir],
                             check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        print(f"{r['prompts']:6d} prompts: peak RSS {r['peak_rss_mb']:.1f} MB "
              f"(after loading {r['rss_before_mb']:.1f} MB; outputs hold ~{r['output_mb']:.2f} MB)")
    small, large = results
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    print(f"growth for {args.factor}x prompts: {growth:.1f} MB; "
          f"outputs grew {large['output_mb'] - small['output_mb']:.2f} MB")


if __name__ == "__main__":
    main()
