"""Shared pieces of the benchmarks: the random-weight model and the workload."""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from shardline.engine.model.tiny import build_tokenizer

# The speed issue's model: Llama-shaped, random weights, float32.
LLAMA_BENCH_CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1536, vocab_size=16384, max_position_embeddings=2048,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)


def scratch_dir(prefix: str) -> str:
    """A fresh temporary directory removed when the benchmark's process exits (a
    bench-sized model is hundreds of MB; left behind, repeated runs fill the disk)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def build_bench_model(path: Path | None = None, **overrides) -> str:
    """Write the benchmark model (random weights) and a tokenizer; return its directory
    (without ``path``, a scratch directory removed at exit)."""
    path = Path(path or scratch_dir("shardline-bench-"))
    build_tokenizer(path)
    config = transformers.LlamaConfig(**{**LLAMA_BENCH_CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path))
    return str(path)


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def non_embedding_params(model: torch.nn.Module) -> int:
    embedding = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embedding


def peak_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5,
                      clock=None) -> dict[str, float]:
    """Best observed FLOP/s of a size x size matmul on this machine's CPU, by torch.mm
    (MKL) and by oneDNN's packed linear (what the engine's CPU linears run): the
    roofline's peak is the larger. Timed by ``clock`` (default: the wall clock)."""
    import time

    clock = clock or time.perf_counter

    from shardline.engine.cpu.linear import onednn_linear_available

    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    candidates = {"torch.mm": lambda: torch.mm(a, b)}
    if onednn_linear_available(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        candidates["oneDNN linear"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    peaks = {}
    for name, matmul in candidates.items():
        matmul()
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            matmul()
            best = min(best, clock() - start)
        peaks[name] = 2 * size**3 / best
    return peaks


class StepProfile:
    """Time of a CPU engine's steps by part (by ``clock``: the wall clock by default,
    or e.g. the thread's CPU time for a one-thread run): scheduling, batch preparation, the
    model forward (its attention split into decode, prefill, the last layer's sampled
    rows, KV-cache writes and per-step planning; decode steps replayed whole, their
    attention included, apart), sampling, and output processing (detokenization, stop
    checks, building outputs).

    Installed by wrapping functions (timing only, no behaviour change); the wrappers
    add a few microseconds per call, so profiled runs are slightly slower. Install it
    after the engine is built (the fused layers look their kernels up at call time).
    """

    ATTENTION = ("decode attention", "prefill attention", "last layer, sampled rows", "kv cache writes",
                 "attention plans")
    REPLAYED = "decode steps replayed whole"

    def __init__(self, clock=None) -> None:
        import time

        from shardline.engine import llm_engine
        from shardline.engine.attention import backends as attention_backends
        from shardline.engine.attention import torch_path as torch_attention
        from shardline.engine.core import scheduler
        from shardline.engine.cpu import decode_programs
        from shardline.engine.model import runner as model_runner
        from shardline.engine.sampling import output_processor, sampler

        self.clock = clock or time.perf_counter
        self.seconds: dict[str, float] = {}
        attend = torch_attention._attend

        def attend_timed(query, k_cache, v_cache, plan, *args):
            kind = "decode attention" if plan.query_valid.shape[1] == 1 else "prefill attention"
            return self._time(kind, attend, query, k_cache, v_cache, plan, *args)

        torch_attention._attend = attend_timed
        # A decode step replayed whole runs its attention inside the replay's one C call:
        # timed as a part of its own (other replays call the attention timed above).
        replay = decode_programs.DecodePrograms._replay

        def replay_timed(programs, program, *args):
            if program.tables is None:
                return replay(programs, program, *args)
            return self._time(self.REPLAYED, replay, programs, program, *args)

        decode_programs.DecodePrograms._replay = replay_timed
        wrapped = (
            (torch_attention, "_attend_decode", "decode attention"),
            (torch_attention, "_attend_fresh", "prefill attention"),
            (torch_attention, "_attend_prefill", "prefill attention"),
            (attention_backends.TorchBackend, "attend_sampled_rows", "last layer, sampled rows"),
            (attention_backends, "write_kv_cache", "kv cache writes"),
            (attention_backends.TorchBackend, "build_context", "attention plans"),
            (model_runner.ModelRunner, "execute", "model forward"),
            (model_runner.ModelRunner, "prepare_inputs", "batch preparation"),
            (scheduler.Scheduler, "schedule", "scheduling"),
            (sampler.Sampler, "__call__", "sampling"),
            (output_processor.OutputProcessor, "append_token", "output processing"),
            (output_processor.OutputProcessor, "make_output", "output processing"),
            (llm_engine.LLMEngine, "step", "engine steps"),
        )
        for owner, name, label in wrapped:
            function = getattr(owner, name)
            setattr(owner, name, lambda *args, _f=function, _label=label: self._time(_label, _f, *args))

    def _time(self, label: str, function, *args):
        start = self.clock()
        try:
            return function(*args)
        finally:
            self.seconds[label] = self.seconds.get(label, 0.0) + self.clock() - start

    def report(self, total: float) -> str:
        get = self.seconds.get
        forward = get("model forward", 0.0) - get("batch preparation", 0.0)
        attention = sum(get(label, 0.0) for label in self.ATTENTION)
        rows = [("scheduling", get("scheduling", 0.0)), ("batch preparation", get("batch preparation", 0.0)),
                ("model forward", forward)]
        rows += [(f"  {label}", get(label, 0.0)) for label in self.ATTENTION]
        replayed = get(self.REPLAYED, 0.0)
        rows += [(f"  {self.REPLAYED}", replayed),
                 ("  linears, norms, MLP, rest", forward - attention - replayed),
                 ("sampling", get("sampling", 0.0)),
                 ("output processing", get("output processing", 0.0)),
                 ("rest of the engine steps", get("engine steps", 0.0) - get("scheduling", 0.0)
                  - get("model forward", 0.0) - get("sampling", 0.0) - get("output processing", 0.0)),
                 ("outside the engine steps", total - get("engine steps", 0.0))]
        return "\n".join(f"  {label:30s} {seconds:7.2f} s" for label, seconds in rows)


def run_clock(cpu_time: bool) -> Callable[[], float]:
    """The clock a benchmark times by: the wall clock, or with ``cpu_time`` (its
    ``--cpu-time`` option, for a machine other work is loading) one thread timed by its
    CPU time, torch limited to that thread."""
    if not cpu_time:
        return time.perf_counter
    torch.set_num_threads(1)
    return time.thread_time



def best_cpu_seconds(run: Callable[[], object], repeat: int, warm_up: bool = False) -> float:
    """The least CPU time of this thread over ``repeat`` calls of ``run`` (one untimed
    call first where ``warm_up``)."""
    if warm_up:
        run()
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        run()
        best = min(best, time.thread_time() - start)
    return best
