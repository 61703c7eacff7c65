"""Offline generate and chat with the engine API, as with vLLM's ``LLM``.

    python examples/offline_generate.py [--model Qwen/Qwen3-0.6B]
"""

from __future__ import annotations

import argparse

from _tiny import model_argument, resolve_model

from shardline import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_argument(parser)
    args = parser.parse_args()
    llm = LLM(resolve_model(args))
    greedy = SamplingParams(temperature=0, max_tokens=16)
    for output in llm.generate(["Hello, my name is", "The capital of France is"], greedy):
        print(f"generate {output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    conversation = [{"role": "user", "content": "Name three prime numbers."}]
    chat = llm.chat([conversation], SamplingParams(temperature=0.7, seed=0, max_tokens=16))[0]
    print(f"chat -> {chat.outputs[0].text!r}")
    llm.close()


if __name__ == "__main__":
    main()
