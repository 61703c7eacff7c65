"""shardline vs Hugging Face transformers on a CUDA GPU, side by side in one process.

A Qwen3-0.6B-shaped model with random weights (bfloat16) on nano-vllm's workload:
256 sequences, prompt and output lengths drawn uniformly from 100-1024, random
prompt tokens, ignore_eos. Prints output tokens/s of shardline (CUDA graphs on, and
optionally eager), transformers' continuous batching (per-request output lengths)
and transformers' static batched generate (left padding; on the first
--hf-static-prompts sequences only, since it is slow), the ratios, and the fraction
of the GPU's memory-bandwidth roofline that shardline's run reaches: the bytes the
run must move (the weights once per forward step, each new token's KV written once,
each decoded token's whole context read once) over the measured copy bandwidth.

    python bench/bench_gpu.py [--num-seqs 256] [--hf-static-prompts 32] [--skip-hf] [--profile] [--sync]

``--profile`` splits a run into forward and sampling on the device, GPU idle time,
and host time busy or waiting for sampled tokens; ``--sync`` also runs shardline
without async scheduling, for the difference it makes.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))

from shardline import LLM, SamplingParams  # noqa: E402
from shardline.engine.model.tiny import build_tokenizer  # noqa: E402

QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


def build_model(path: Path) -> str:
    build_tokenizer(path)
    config = transformers.Qwen3Config(**QWEN3_0_6B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path))
    del model
    torch.cuda.empty_cache()
    return str(path)


def workload(num_seqs: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: prompt tokens uniform in [0, 10000), lengths uniform in [100, 1024]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    output_lens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, output_lens


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bytes/s (read + write), best of a few."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * num_bytes / best


class DeviceProfile:
    """Where a run's time goes, without adding synchronisation (so async scheduling
    keeps its overlap): CUDA events around each step's forward and sampling give the
    device's busy time; the time the host spends waiting for sampled tokens
    (SamplerOutput.host_token_ids) is its idle time. Per step: forward (device), sampling
    (device), GPU idle (wall time the device had no step's work queued), host busy and
    host waiting."""

    def __init__(self, engine) -> None:
        from shardline.engine.sampling.sampler import SamplerOutput

        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = []
        self.host_wait = 0.0
        self._open: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        execute, sampler = engine.runner.execute, engine.sampler
        host_token_ids = SamplerOutput.host_token_ids

        def event() -> torch.cuda.Event:
            marker = torch.cuda.Event(enable_timing=True)
            marker.record()
            return marker

        def timed_execute(*args, **kwargs):
            start = event()
            output = execute(*args, **kwargs)
            self._open = (start, event())
            return output

        def timed_sampler(*args, **kwargs):
            output = sampler(*args, **kwargs)
            if self._open is not None:
                self.spans.append((*self._open, event()))
                self._open = None
            return output

        def timed_wait(sampled):
            start = time.perf_counter()
            try:
                return host_token_ids(sampled)
            finally:
                self.host_wait += time.perf_counter() - start

        engine.runner.execute, engine.sampler = timed_execute, timed_sampler
        SamplerOutput.host_token_ids = timed_wait
        self._restore = lambda: setattr(SamplerOutput, "host_token_ids", host_token_ids)

    def report(self, elapsed: float, steps: int) -> str:
        torch.cuda.synchronize()
        self._restore()
        forward = sum(start.elapsed_time(middle) for start, middle, _ in self.spans) / 1000
        sampling = sum(middle.elapsed_time(end) for _, middle, end in self.spans) / 1000
        parts = {"forward (device)": forward, "sampling (device)": sampling,
                 "GPU idle": max(0.0, elapsed - forward - sampling),
                 "host busy": elapsed - self.host_wait, "host waiting for the device": self.host_wait}
        return ", ".join(f"{name} {1000 * seconds / steps:.2f}" for name, seconds in parts.items())


def run_shardline(model_dir: str, prompts, output_lens, enforce_eager: bool,
                  profile: bool = False, async_scheduling: bool | None = None) -> tuple[float, int]:
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.45,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    llm.generate({"prompt_token_ids": prompts[0][:32]}, SamplingParams(max_tokens=4), use_tqdm=False)
    engine = llm.llm_engine
    device_profile = DeviceProfile(engine) if profile else None
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    steps_before = engine.num_steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = engine.num_steps - steps_before
    if device_profile is not None:
        print(f"profile (ms per step, async scheduling {'on' if engine.async_scheduling else 'off'}): "
              f"{device_profile.report(elapsed, steps)}", flush=True)
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return elapsed, steps


def run_hf_continuous(model, prompts, output_lens) -> float:
    """transformers' continuous batching, each request with its own output length."""
    config = transformers.GenerationConfig(max_new_tokens=max(output_lens), do_sample=False,
                                           eos_token_id=-1, pad_token_id=2)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lens)]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                pending.discard(result.request_id)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
        elapsed = time.perf_counter() - start
    return elapsed


def run_hf_static(model, prompts, output_lens, batch_size: int) -> float:
    """transformers' generate over left-padded batches; each batch runs to its longest output."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        steps = max(output_lens[i : i + batch_size])
        width = max(len(p) for p in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=2)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def needed_bytes(model_dir: str, prompts, output_lens, steps: int) -> float:
    """Bytes a run must move: weights once per step, KV written once per token, and
    every decoded token's context read once."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    embedding = config.vocab_size * config.hidden_size
    layer = (config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
             + config.num_attention_heads * config.head_dim * config.hidden_size
             + 3 * config.hidden_size * config.intermediate_size)
    weight_bytes = 2 * (embedding + config.num_hidden_layers * layer)  # tied lm_head: read once
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    written = sum(len(p) + n for p, n in zip(prompts, output_lens)) * kv_per_token
    read = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, output_lens)) * kv_per_token
    return steps * weight_bytes + written + read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--hf-static-prompts", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--eager", action="store_true", help="also run shardline without CUDA graphs")
    parser.add_argument("--skip-continuous", action="store_true", help="no transformers continuous batching")
    parser.add_argument("--profile", action="store_true",
                        help="a second shardline run split into forward, sampling, GPU idle and host time "
                             "(CUDA events, no added synchronisation)")
    parser.add_argument("--sync", action="store_true",
                        help="also run shardline without async scheduling (and profile it with --profile)")
    args = parser.parse_args()

    model_dir = build_model(Path(tempfile.mkdtemp(prefix="shardline-gpu-bench-")))
    prompts, output_lens = workload(args.num_seqs)
    output_tokens = sum(output_lens)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"workload: {args.num_seqs} sequences, {sum(map(len, prompts))} prompt tokens, "
          f"{output_tokens} output tokens (lengths 100-1024), greedy, bfloat16", flush=True)
    bandwidth = copy_bandwidth()
    print(f"measured device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)

    results: dict[str, tuple[float, int]] = {}
    elapsed, steps = run_shardline(model_dir, prompts, output_lens, enforce_eager=False)
    results["shardline"] = (elapsed, output_tokens)
    print(f"shardline (CUDA graphs)            {elapsed:8.2f} s  {output_tokens / elapsed:9.1f} output tok/s "
          f"({steps} steps)", flush=True)
    moved = needed_bytes(model_dir, prompts, output_lens, steps)
    print(f"memory roofline: {moved / elapsed / 1e12:.2f} TB/s needed-bytes rate = "
          f"{100 * moved / elapsed / bandwidth:.1f}% of the measured copy bandwidth", flush=True)
    if args.profile:
        run_shardline(model_dir, prompts, output_lens, enforce_eager=False, profile=True)
    if args.sync:
        elapsed, _ = run_shardline(model_dir, prompts, output_lens, enforce_eager=False, profile=args.profile,
                                   async_scheduling=False)
        results["shardline without async scheduling"] = (elapsed, output_tokens)
        print(f"shardline (no async scheduling)    {elapsed:8.2f} s  {output_tokens / elapsed:9.1f} output tok/s",
              flush=True)
    if args.eager:
        eager, _ = run_shardline(model_dir, prompts, output_lens, enforce_eager=True)
        results["shardline eager"] = (eager, output_tokens)
        print(f"shardline (eager)                  {eager:8.2f} s  {output_tokens / eager:9.1f} output tok/s",
              flush=True)

    if not args.skip_hf:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        with torch.inference_mode():
            try:
                if args.skip_continuous:
                    raise RuntimeError("skipped (--skip-continuous)")
                seconds = run_hf_continuous(model, prompts, output_lens)
                results["transformers continuous batching"] = (seconds, output_tokens)
                print(f"transformers continuous batching   {seconds:8.2f} s  "
                      f"{output_tokens / seconds:9.1f} output tok/s", flush=True)
            except Exception as exc:  # report and go on to the static baseline
                print(f"transformers continuous batching failed: {type(exc).__name__}: {exc}", flush=True)
            subset = args.hf_static_prompts
            sub_tokens = sum(output_lens[:subset])
            seconds = run_hf_static(model, prompts[:subset], output_lens[:subset], args.hf_batch_size)
            results["transformers static generate"] = (seconds, sub_tokens)
            print(f"transformers static generate       {seconds:8.2f} s  {sub_tokens / seconds:9.1f} output tok/s "
                  f"(first {subset} sequences, batch {args.hf_batch_size})", flush=True)

    ours = output_tokens / results["shardline"][0]
    for name, (seconds, tokens) in results.items():
        if name != "shardline":
            print(f"shardline / {name}: {ours / (tokens / seconds):.2f}x (tokens/s ratio)")


if __name__ == "__main__":
    main()
