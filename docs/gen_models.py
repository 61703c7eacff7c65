"""Regenerate the supported-models page (docs/models.md) from the model-coverage sweep.

For each model type the sweep (tests/engine/coverage.py) builds a tiny random model
and compares shardline's greedy tokens with transformers'; its outcome and reason are
the row's status, as the sweep words them. For a type at parity the tiny model is then
loaded once more, in float32 with every CPU fast path allowed
(``SHARDLINE_CPU_PATHS=all=on``), to read what the engine made of it: its cache layer
kinds, attention features, recurrent kinds and the CPU modules it replaced. Where the
host cannot run a path (no C compiler, no oneDNN) the row shows less than it could.

The results are kept in docs/models.json and the page is rendered from them, so a
partial rerun (``--types llama gpt2``) updates those rows alone:

    python docs/gen_models.py              # every type (tens of minutes on two cores)
    python docs/gen_models.py --fast       # the sweep's representative set
    python docs/gen_models.py --render     # the page from docs/models.json as it is

tests/test_docs.py fails when the page is stale against the sweep's representative set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the sweep lives in tests/
    sys.path.insert(0, str(REPO))

from shardline import LLM  # noqa: E402
from shardline.engine.model.tiny import build_tiny_model  # noqa: E402
from tests.engine.coverage import (  # noqa: E402
    REPRESENTATIVE,
    VOCAB_SIZE,
    CoverageResult,
    decoder_model_types,
    quiet_transformers,
    sweep,
    tiny_overrides,
)

RESULTS = REPO / "docs" / "models.json"
PAGE = REPO / "docs" / "models.md"
# The image-text-to-text sweep's lines (tests/engine/multimodal/test_vlm_sweep.py writes them).
IMAGE_RESULTS = REPO / "docs" / "models_images.json"
STATUS = {"parity": "token-exact", "refused": "refused", "failure": "failure", "skipped": "not swept"}
ADAPTER_MODULE_PREFIX = "shardline.engine.model.adapters"


@dataclass(frozen=True)
class ModelRow:
    """One model type's row: the sweep's outcome and what the engine used to run it."""

    model_type: str
    outcome: str
    detail: str = ""
    attention: list[str] = field(default_factory=list)
    recurrent: list[str] = field(default_factory=list)
    cpu_paths: list[str] = field(default_factory=list)
    second: str = ""  # the second tiny config's outcome (tests/engine/coverage_configs.py), with its reason


def engine_features(model_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """(attention features, recurrent kinds, CPU fast paths) of the model in ``model_dir``
    as a float32 CPU engine with every fast path allowed runs it."""
    previous = os.environ.get("SHARDLINE_CPU_PATHS")
    os.environ["SHARDLINE_CPU_PATHS"] = "all=on"
    try:
        llm = LLM(str(model_dir), dtype="float32", device="cpu", check_model=False,
                  max_num_batched_tokens=16, max_num_seqs=4)
    finally:
        if previous is None:
            os.environ.pop("SHARDLINE_CPU_PATHS")
        else:
            os.environ["SHARDLINE_CPU_PATHS"] = previous
    try:
        engine = llm.llm_engine
        return (_attention_features(engine.model, engine.runner.spec.layers, engine.hf_config),
                _recurrent_kinds(engine.model), _cpu_paths(engine.cpu_paths, engine.cpu_rewrites))
    finally:
        llm.close()


def _attention_features(model: torch.nn.Module, layers: tuple, hf_config) -> list[str]:
    """Cache layer kinds and the attention features the layers' specs and modules show."""
    kinds = {str(layer.kind) for layer in layers if layer.num_kv_heads}
    features = sorted(f"{kind.replace('_', ' ')} attention" for kind in kinds)
    if "sliding_window" not in kinds and any(layer.sliding_window for layer in layers):
        features.append("sliding window")  # a window on layers of another cache kind
    indexed = any(getattr(module, "indexed", False) is True for module in model.modules())
    # A sparse attention's layers keep their index keys where values would be: no value head size.
    if not indexed and any(layer.num_kv_heads and layer.head_dim != layer.value_head_dim for layer in layers):
        features.append("keys and values of different head sizes")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        features.append("attention sinks")
    if indexed:
        features.append("sparse attention (indexer's top-k keys)")
    text_config = hf_config.get_text_config()
    if getattr(text_config, "attn_logit_softcapping", None):
        features.append("softcap")
    adapters = sorted({type(module).__name__ for module in model.modules()
                       if type(module).__module__.startswith(ADAPTER_MODULE_PREFIX)})
    features.extend(f"adapter {name}" for name in adapters)
    return features


def _recurrent_kinds(model: torch.nn.Module) -> list[str]:
    """The recurrent kinds of the layers the engine runs with state slots (each such
    layer wraps its HF mixer and answers ``state_shapes`` through its kind)."""
    return sorted({module.kind.name for module in model.modules()
                   if hasattr(module, "state_shapes") and hasattr(getattr(module, "kind", None), "name")})


def _cpu_paths(paths, rewrites) -> list[str]:
    """The CPU paths taken, with how many modules each replaced."""
    taken = [f"{name.replace('_', ' ')} ({count})" for name, count in asdict(rewrites).items() if count]
    taken += [name.replace("_", " ") for name in ("decode_kernel", "prefill_kernel") if getattr(paths, name)]
    return taken


def model_row(result: CoverageResult, workdir: Path, second: CoverageResult | None = None) -> ModelRow:
    """The page's row for one sweep result (its first config; ``second``, the type's
    second config); a type at parity is loaded for its features."""
    second_status = "" if second is None else status_text(second.outcome, second.detail)
    row = ModelRow(result.model_type, result.outcome, result.detail, second=second_status)
    if result.outcome != "parity":
        return row
    model_dir = build_tiny_model(workdir / f"{result.model_type}-features", result.model_type,
                                 vocab_size=VOCAB_SIZE, **tiny_overrides(result.model_type))
    attention, recurrent, cpu_paths = engine_features(model_dir)
    return ModelRow(result.model_type, result.outcome, result.detail, attention, recurrent, cpu_paths, second_status)


def status_text(outcome: str, detail: str) -> str:
    """An outcome as the page words it, with its reason."""
    return STATUS[outcome] + (f": {detail}" if detail else "")


def sweep_rows(model_types: list[str], echo=print) -> Iterator[ModelRow]:
    """The sweep over ``model_types``, one type at a time in both its configs, and each type's row."""
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="shardline-models-") as workdir:
        for model_type in model_types:
            results = sweep([model_type], Path(workdir), echo=echo)
            yield model_row(results[0], Path(workdir), results[1] if len(results) > 1 else None)


def load_rows(path: Path = RESULTS) -> dict[str, ModelRow]:
    if not path.exists():
        return {}
    return {row["model_type"]: ModelRow(**row) for row in json.loads(path.read_text())}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: dict[str, ModelRow]) -> str:
    """The page's Markdown for ``rows``, one table row per model type in name order."""
    counts = {outcome: sum(row.outcome == outcome for row in rows.values()) for outcome in STATUS}
    lines = [
        "# Supported models",
        "",
        "<!-- Generated by docs/gen_models.py from the model-coverage sweep; do not edit by hand. -->",
        "",
        "Every decoder-only model type in the installed transformers' causal-LM mapping, built tiny "
        "and random and compared token for token with transformers' greedy generate "
        "(`python -m tests.engine.coverage`). **token-exact**: shardline's tokens equal transformers' "
        "on every prompt; **refused**: the engine refuses the model at load, for the reason given, "
        "rather than run it differently; **not swept**: not a decoder-only text model. "
        "Image-text models are listed here by their text decoders, and by their images below. Each type runs in "
        "two tiny configs (the second: other head counts, key-value heads neither one nor one per "
        "query head, another layer count, KV sharing and nested config fields where the type has "
        "them); the status is the first's, the second config's is in its own column.",
        "",
        "Attention and recurrent features and CPU fast paths are read from the engine that ran the "
        "tiny model in float32 on CPU with every fast path allowed; the numbers count the modules "
        "replaced. Regenerate with `python docs/gen_models.py` (see [Benchmarks](benchmarks.md) for "
        "the host).",
        "",
        "Counts: " + ", ".join(f"{STATUS[outcome]} {count}" for outcome, count in counts.items()) + ".",
        "",
        "| Model type | Status | Second config | Attention | Recurrent | CPU fast paths |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(rows):
        row = rows[name]
        second = "same" if row.second == status_text(row.outcome, row.detail) and row.detail else row.second
        cells = (f"`{name}`", status_text(row.outcome, row.detail), second, ", ".join(row.attention),
                 ", ".join(row.recurrent), ", ".join(row.cpu_paths))
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines + image_section()) + "\n"


def image_section() -> list[str]:
    """The page's lines for images: one row per type of transformers' image-text-to-text
    mapping from the last image sweep (``python -m tests.engine.multimodal.test_vlm_sweep``)."""
    if not IMAGE_RESULTS.exists():
        return []
    lines = [
        "",
        "## Images",
        "",
        "Every type in the installed transformers' image-text-to-text mapping, from the image sweep "
        "(`python -m tests.engine.multimodal.test_vlm_sweep`): **parity**: a tiny random model's "
        "greedy tokens with images equal transformers' generate (and the image changes them); "
        "**text only**: its text model runs and its image prompts are refused; **refused**: the "
        "engine refuses it at load, for the reason given.",
        "",
        "| Model type | Images |",
        "|---|---|",
    ]
    results = json.loads(IMAGE_RESULTS.read_text())
    running = [result["model_type"] for result in results if result["outcome"] == "parity"]
    lines[-2:-2] = ["Run with images: " + ", ".join(f"`{name}`" for name in running) + ".", ""]
    for result in results:
        # The refusals' list of the types that run is the line above.
        detail = result["detail"].split(" (vision-language types it runs:")[0]
        status = result["outcome"] + (f": {detail}" if detail else "")
        lines.append(f"| `{result['model_type']}` | {_cell(status)} |")
    return lines


def write(rows: dict[str, ModelRow]) -> None:
    RESULTS.write_text(json.dumps([asdict(rows[name]) for name in sorted(rows)], indent=1) + "\n")
    PAGE.write_text(render(rows))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", help="model types to sweep again (default: every type)")
    parser.add_argument("--fast", action="store_true", help="the sweep's representative set")
    parser.add_argument("--render", action="store_true", help="render the page from docs/models.json only")
    args = parser.parse_args(argv)
    rows = load_rows()
    if not args.render:
        types = list(REPRESENTATIVE) if args.fast else args.types or decoder_model_types()
        torch.set_num_threads(1)  # tiny models: threads only contend
        for row in sweep_rows(types, echo=lambda line: print(line, flush=True)):
            rows[row.model_type] = row
            write(rows)
        # Types the installed transformers no longer has leave the page.
        rows = {name: row for name, row in rows.items() if name in set(decoder_model_types())}
    write(rows)
    print(f"wrote {PAGE.relative_to(REPO)} ({len(rows)} model types)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
