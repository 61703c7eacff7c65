"""The model-coverage sweep: every decoder-only model type in the installed
transformers' causal-LM mapping, built tiny and random, run through shardline's
``LLM`` and compared token for token with transformers' own greedy generate.

Each type ends in one class:
- ``parity``: shardline's greedy tokens equal transformers' on every prompt;
- ``refused``: shardline refused the model at load with one of its own errors (the
  reason is the error's message);
- ``failure``: wrong tokens, a crash, or a tiny model the sweep could not build or
  whose reference does not depend on the context (the detail names the stage);
- ``skipped``: not a decoder-only text LM (an encoder, the decoder half of an
  encoder-decoder, an audio model), with the reason.

The reference runs in float64 where the model's code takes it, else in float32 (some
MoE code refuses float64), and shardline in the same dtype. Weights are drawn with
std 0.2 (engine/model/tiny.py) and the sweep checks that replacing a prompt's context
changes the reference's tokens, so a dropped state or an ignored mask cannot pass.

Run it directly for a report: ``python -m tests.engine.coverage [TYPE ...]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardline import LLM, SamplingParams
from shardline.engine.errors import ModelLoadError
from shardline.engine.model.tiny import build_tiny_model, build_tokenizer, tiny_config

from .coverage_configs import SKIPPED, VOCAB_SIZE, second_config, tiny_overrides

__all__ = ["SKIPPED", "VOCAB_SIZE", "second_config", "tiny_overrides"]  # the configs' names others import from here

MAX_NEW_TOKENS = 6
PROMPT_LENGTHS = (3, 13, 30)
MAX_PARAMETERS = 20_000_000  # a tiny model is under a million or so; more means a size the overrides missed
OUTCOMES = ("parity", "refused", "failure", "skipped")
CONFIGS = (1, 2)  # each type's tiny configs: tiny_overrides' first, second_config's

# Types run by default in the test suite: one per attention shape the sweep meets.
REPRESENTATIVE = ("llama", "gpt2", "gemma3_text", "qwen3_moe", "gpt_oss", "qwen3_next", "falcon", "bloom", "gpt_neo",
                  "gpt_bigcode", "jetmoe", "deepseek_v2", "diffllama")


# Types run in their second config by default: the three whose second config once
# crashed (a nested KV-head count, KV sharing over few layers, attention by name) and a
# handful of attention shapes.
SECOND_REPRESENTATIVE = ("dbrx", "gemma3n_text", "git", "llama", "gpt2", "qwen3_moe", "deepseek_v2", "falcon")


@dataclass(frozen=True)
class CoverageResult:
    """One model type's outcome; ``detail`` is the reason or the first difference."""

    model_type: str
    outcome: str
    detail: str = ""
    dtype: str = ""
    seconds: float = 0.0
    config: int = 1  # which of the type's tiny configs (CONFIGS)

    def line(self) -> str:
        dtype = f" [{self.dtype}]" if self.dtype else ""
        detail = f": {self.detail}" if self.detail else ""
        name = self.model_type if self.config == 1 else f"{self.model_type}#{self.config}"
        return f"{name:<30} {self.outcome:<8}{dtype}{detail}"


def decoder_model_types() -> list[str]:
    """Every model type in the installed transformers' causal-LM mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def write_tiny_config(model_type: str, model_dir: Path) -> Path:
    """The tiny ``model_type`` the sweep builds, its config and tokenizer only (no
    weights): what the engine's verdict (engine/model/support.py) and pre-flight read."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_dir, vocab_size=VOCAB_SIZE)
    tiny_config(model_type, len(tokenizer), **tiny_overrides(model_type)).save_pretrained(str(model_dir))
    return model_dir


def _parameter_count(model_type: str, overrides: dict) -> int:
    """Parameters of the tiny model, counted without allocating them."""
    config = tiny_config(model_type, VOCAB_SIZE, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS]


@torch.inference_mode()
def _reference(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time, EOS included when hit."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                   do_sample=False, pad_token_id=2)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _load_reference(model_dir: str) -> tuple[transformers.PreTrainedModel, list[list[int]], str]:
    """The reference model and its tokens, in float64 where its code runs it."""
    error: Exception | None = None
    for dtype in (torch.float64, torch.float32):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation="eager").eval()
            return model, _reference(model, _prompts()), str(dtype).removeprefix("torch.")
        except Exception as exc:  # noqa: BLE001 - some MoE code refuses float64
            error = exc
    raise error


def _context_matters(model: transformers.PreTrainedModel, expected: list[list[int]]) -> bool:
    """Whether replacing a prompt's context (all but its last token) changes the
    reference's tokens, for at least one of the longer prompts."""
    others = _prompts(seed=1)
    for prompt, other, want in list(zip(_prompts(), others, expected))[1:]:
        if _reference(model, [other[:-1] + prompt[-1:]])[0] != want:
            return True
    return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check_type(model_type: str, workdir: Path, config: int = 1) -> CoverageResult:
    """Build ``model_type`` tiny (its ``config``-th tiny config), run it both ways and
    classify the outcome."""
    if model_type in SKIPPED:
        return CoverageResult(model_type, "skipped", SKIPPED[model_type], config=config)
    result = _check_built(model_type, workdir / f"{model_type}-{config}", config)
    return dataclasses.replace(result, config=config)


def _check_built(model_type: str, model_dir: Path, config: int) -> CoverageResult:
    """``check_type``'s build, reference, load and comparison."""
    try:
        overrides = tiny_overrides(model_type, config)
        num_parameters = _parameter_count(model_type, overrides)
        if num_parameters > MAX_PARAMETERS:
            return CoverageResult(model_type, "failure", f"tiny build: {num_parameters} parameters with the sweep's "
                                  f"overrides, over {MAX_PARAMETERS}; it needs its own in OVERRIDES")
        build_tiny_model(model_dir, model_type, vocab_size=VOCAB_SIZE, **overrides)
    except Exception as exc:  # noqa: BLE001 - the sweep reports every way a type fails
        return CoverageResult(model_type, "failure", f"tiny build: {_one_line(exc)}")
    try:
        reference_model, expected, dtype = _load_reference(str(model_dir))
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"transformers reference: {_one_line(exc)}")
    # A refusal stands whatever the weights; parity means something only where the
    # reference's tokens depend on the context.
    try:
        llm = LLM(str(model_dir), dtype=dtype, max_num_batched_tokens=16, max_num_seqs=4)
    except ModelLoadError as exc:
        return CoverageResult(model_type, "refused", " ".join(str(exc).split()), dtype)
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"load crashed: {_one_line(exc)}", dtype)
    if not _context_matters(reference_model, expected):
        llm.close()
        return CoverageResult(model_type, "failure", "reference tokens do not depend on the context", dtype)
    del reference_model
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        ours = [list(output.outputs[0].token_ids) for output in outputs]
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"generate crashed: {_one_line(exc)}", dtype)
    finally:
        llm.close()
    for index, (got, want) in enumerate(zip(ours, expected)):
        if got != want:
            return CoverageResult(model_type, "failure",
                                  f"wrong tokens on prompt {index}: {got} vs transformers' {want}", dtype)
    return CoverageResult(model_type, "parity", "", dtype)


def _check_type_alone(model_type: str, config: int = 1) -> CoverageResult:
    """``check_type`` in a fresh process: what one type does is then free of what the
    types before it left in this one (kernels a model's code picked, loaded modules)."""
    completed = subprocess.run([sys.executable, "-m", "tests.engine.coverage", "--json", model_type, str(config)],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = " ".join(completed.stderr.split()[-40:])
        return CoverageResult(model_type, "failure", f"sweep process exited {completed.returncode}: {tail[:300]}",
                              config=config)
    return CoverageResult(**json.loads(lines[-1]))


def sweep(model_types: list[str], workdir: Path, echo=print,
          configs: tuple[int, ...] = CONFIGS) -> list[CoverageResult]:
    """``check_type`` over ``model_types``, each of its ``configs``, echoing one line per
    type and config and the counts. A failure is checked again in a fresh process, and
    that result is the type's."""
    results = []
    for model_type, config in [(model_type, config) for model_type in model_types for config in configs]:
        if config > 1 and model_type in SKIPPED:
            continue
        start = time.perf_counter()
        try:
            result = check_type(model_type, workdir, config)
        except Exception as exc:  # noqa: BLE001
            result = CoverageResult(model_type, "failure", f"sweep crashed: {_one_line(exc)}", config=config)
        if result.outcome == "failure":
            result = _check_type_alone(model_type, config)
        result = dataclasses.replace(result, seconds=time.perf_counter() - start)
        results.append(result)
        echo(result.line())
    counts = Counter(result.outcome for result in results)
    echo("counts: " + ", ".join(f"{outcome} {counts[outcome]}" for outcome in OUTCOMES))
    return results


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers while sweeping."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("shardline").setLevel(logging.ERROR)


def main(argv: list[str]) -> int:
    """``[--config C] [--part I/N] [TYPE ...]``: the given types (default all), or the
    I-th of N interleaved parts of them, so several processes can share a sweep; each
    type in both tiny configs, or in config C alone."""
    if argv[:1] == ["--json"]:  # one type and config, its result as JSON (_check_type_alone)
        quiet_transformers()
        torch.set_num_threads(1)
        config = int(argv[2]) if len(argv) > 2 else 1
        with tempfile.TemporaryDirectory(prefix="shardline-coverage-") as workdir:
            print(json.dumps(dataclasses.asdict(check_type(argv[1], Path(workdir), config))), flush=True)
        return 0
    configs = CONFIGS
    if argv[:1] == ["--config"]:
        configs, argv = (int(argv[1]),), argv[2:]
    part = None
    if argv[:1] == ["--part"]:
        index, count = map(int, argv[1].split("/"))
        part, argv = (index, count), argv[2:]
    types = argv or decoder_model_types()
    if part is not None:
        types = types[part[0]::part[1]]
    quiet_transformers()
    torch.set_num_threads(1)  # tiny models: threads only contend
    with tempfile.TemporaryDirectory(prefix="shardline-coverage-") as workdir:
        results = sweep(types, Path(workdir), echo=lambda line: print(line, flush=True), configs=configs)
    return 1 if any(result.outcome == "failure" for result in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
