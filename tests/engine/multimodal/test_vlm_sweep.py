"""The sweep over transformers' image-text-to-text mapping: one line per model type,
parity (token-exact with transformers' generate on a tiny random model, images
changing its tokens), refused with its reason (the one verdict,
engine/model/support.py), text only (loaded as a causal LM: its image prompts are
refused), or failure.

A fast set runs by default; the whole mapping is marked slow (``-m slow``).
``python -m tests.engine.multimodal.test_vlm_sweep`` sweeps the whole mapping and writes
its lines to docs/models_images.json, which the supported-models page renders.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from shardline import LLM, SamplingParams
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny_qwen_vl import QWEN_VL_TYPES, build_tiny_qwen_vl
from shardline.engine.model.tiny_vlm import build_tiny_llava, build_tiny_llava_next
from shardline.engine.model.tiny_vlm_gemma3 import build_tiny_gemma3
from shardline.engine.model.tiny_vlm_idefics3 import build_tiny_idefics3
from shardline.engine.model.tiny_vlm_pixtral import build_tiny_mistral3
from shardline.engine.model.tiny_vlm_smolvlm import build_tiny_smolvlm
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.specs import VISION_SPECS, vision_spec

from .conftest import images

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "models_images.json"
# Tiny builders of the vision-language types the engine runs.
TINY_BUILDERS = {"llava": build_tiny_llava, "llava_next": build_tiny_llava_next,
                 "vipllava": partial(build_tiny_llava, model_type="vipllava"), "gemma3": build_tiny_gemma3,
                 "idefics3": build_tiny_idefics3, "smolvlm": build_tiny_smolvlm,
                 "mistral3": build_tiny_mistral3,
                 **{model_type: partial(build_tiny_qwen_vl, model_type=model_type) for model_type in QWEN_VL_TYPES}}
# One type per outcome: the types at parity have their own fast tests (test_llava.py,
# test_qwen_vl.py, ...), and vipllava's line is its only one.
FAST_SET = ("vipllava", "paligemma", "mllama")
MAX_TOKENS = 6


@dataclass
class SweepResult:
    model_type: str
    outcome: str  # parity, refused, text only, failure
    detail: str = ""

    def line(self) -> str:
        return f"{self.model_type:28s} {self.outcome}{': ' + self.detail if self.detail else ''}"


def _parity(model_type: str, folder: Path) -> SweepResult:
    model_dir = str(TINY_BUILDERS[model_type](folder))
    processor = load_processor(model_dir, model_type)  # without its video processor where torchvision is missing
    assert processor is not None, f"{model_dir} has no processor"
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32")
    text = f"a picture: {processor.image_token} what is it?"
    expected = []
    for picture in images(2):
        inputs = processor(text=text, images=[picture], return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    if expected[0] == expected[1]:
        return SweepResult(model_type, "failure", "the reference's tokens do not depend on the image")
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": p}} for p in images(2)],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    if got != expected:
        return SweepResult(model_type, "failure", f"tokens {got} where transformers gives {expected}")
    return SweepResult(model_type, "parity")


def check_type(model_type: str, folder: Path) -> SweepResult:
    """One model type's sweep line."""
    try:
        if model_type in TINY_BUILDERS:
            return _parity(model_type, folder)
        config = transformers.AutoConfig.for_model(model_type)
        support = model_support(config, "generate")
        if not support.ok:
            return SweepResult(model_type, "refused", support.reason or "")
        if vision_spec(config) is None:
            return SweepResult(model_type, "text only", f"loads as {support.architecture}; its image prompts are "
                               "refused (no vision spec in engine/multimodal/specs.py)")
        return SweepResult(model_type, "failure", "a vision spec without a tiny builder in this sweep")
    except Exception as exc:  # noqa: BLE001 - every crash is a sweep line
        return SweepResult(model_type, "failure", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


@pytest.mark.parametrize("model_type", FAST_SET)
def test_fast_set(model_type, tmp_path):
    result = check_type(model_type, tmp_path)
    print(result.line())
    assert result.outcome in (("parity",) if model_type in VISION_SPECS else ("refused", "text only")), \
        result.line()


def test_refusals_name_the_vision_language_types_that_run():
    config = transformers.AutoConfig.for_model("paligemma")
    support = model_support(config, "generate")
    assert not support.ok and f"vision-language types it runs: {', '.join(sorted(VISION_SPECS))}" in \
        (support.reason or "")


@pytest.mark.slow
def test_full_sweep(tmp_path):
    results = [check_type(model_type, tmp_path / model_type) for model_type in
               sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)]
    for result in results:
        print(result.line())
    counts = {outcome: sum(r.outcome == outcome for r in results) for outcome in
              ("parity", "refused", "text only", "failure")}
    print(counts)
    assert counts["failure"] == 0, [r.line() for r in results if r.outcome == "failure"]


def write_sweep(folder: Path) -> list[SweepResult]:
    """The whole mapping's sweep lines, printed and written to RESULTS."""
    results = []
    for model_type in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        results.append(check_type(model_type, folder / model_type))
        print(results[-1].line(), flush=True)
    RESULTS.write_text(json.dumps([asdict(result) for result in results], indent=1) + "\n")
    return results


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as workdir:
        write_sweep(Path(workdir))
