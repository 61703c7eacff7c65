"""The load-time check that the engine computes what the model itself computes.

Before an engine serves, a few short prompts go through its real paged path: prefilled
in chunks of a few tokens (so later chunks attend a cached context), then decoded a
few steps, on a scheduler of the check's own over the engine's KV cache (the blocks
are free again afterwards and no prefix is remembered). Each decoder layer's output
and the logits at every row the engine reads are compared with the model's own
forward over the same whole sequences without a cache, in transformers' eager
attention (module replacements stay in place: each was checked against the module it
replaced when it was made).

Where they differ, the model is refused with ModelMismatchError naming the
architecture, the first layer (and its class) whose output differs, and the first
position. Tolerances, relative to the reference's largest value at the position:
float64 1e-6, float32 1e-3, and 0.1 in bfloat16 and float16, whose rounding over a
few layers reaches a few percent while an ignored attention feature or dropped state
moves outputs by their own size. A model whose recurrent layers' own code computes in
float32 whatever the model's dtype (a kind's ``reference_dtype``, e.g. the gated delta
rule), or whose attention code does (FLOAT32_ATTENTION_MODEL_TYPES), is compared at
float32's tolerance at most: its own forward is no more exact.

A quantized model's reference runs its quantized linears through the plain-torch
references (engine/kernels/quant_reference.py): its transformers forward with the
weights dequantized, against the engine's kernels. Weight-only kernels compute the same
float32 product and take the dtype's tolerance; a layer whose kernel quantizes its
activations (FP8 W8A8 on CUDA) takes at least ACTIVATION_QUANTIZED_TOLERANCE
(engine/quantization/linear.py).

The reference is the model's forward over the whole sequence, except where a recurrent
layer's own code computes a single token that continues a state differently from a
chunk of the same tokens (a kind's ``decode_differs_from_scan``: Mamba-2's mixers floor
the time step at time_step_min in their chunked scan but not in their one-token
update). There the reference is what the model's generate computes: the prompt in one
forward, then each later token alone on the model's own cache, and the engine, which
takes the same branches, is compared with it at the same tolerances.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerConfig
from ..errors import ModelLoadError
from ..multimodal.inputs import ProcessedPrompt
from ..params import SamplingParams
from ..quantization.linear import dequantized_reference, quantized_tolerance
from ..recurrent.state import RecurrentLayer
from ..surgery import decoder_layers
from .runner import ModelRunner

TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
PROMPT_LENGTHS = (9, 14, 3)
CHUNK_TOKENS = 8  # the check's token budget per step: prompts cross chunk boundaries
DECODE_STEPS = 3


class ModelMismatchError(ModelLoadError):
    """The engine's paged path computes something other than the model's own forward."""


@dataclass
class _Trace:
    """What the paged path computed for one request, by absolute position."""

    layers: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # layer -> position -> [hidden]
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V]


def check_model(runner: ModelRunner, vocab_size: int, max_model_len: int, architecture: str,
                image_prompt: ProcessedPrompt | None = None) -> None:
    """Run the check (see the module docstring); raise ModelMismatchError on a mismatch.
    ``image_prompt``: a vision-language model's probe with an image, run beside the
    others (its image rows scattered by the runner's encoder cache) and compared with
    the model's own forward on the same pixels."""
    model = runner.model
    # The reference is the model's own transformers forward (its config, eager attention).
    assert isinstance(model, PreTrainedModel), f"{type(model).__name__} is not a transformers model"
    _, layers = decoder_layers(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(length)] for length in PROMPT_LENGTHS]
    if runner.recurrent_states and runner.num_state_slots > len(prompts) + 2:
        # Two probes sharing their first block: the second continues the state the first
        # saved there (prefix caching for recurrent layers, core/state_slots.py).
        shared = [rng.randrange(3, vocab_size) for _ in range(runner.block_size)]
        prompts += [shared + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 5)]
    with torch.inference_mode():
        requests, traces = _run_paged(runner, layers, prompts, max_model_len, image_prompt)
        incremental = _decode_differs_from_scan(model)
        with dequantized_reference(model):  # quantized linears through the plain-torch references
            for request in requests:
                _compare(model, layers, request.all_token_ids[:-1], traces[request.request_id],
                         _reference_dtype(runner, model.config), architecture,
                         request.num_prompt_tokens if incremental else None, _pixel_inputs(request))


# Model types whose own attention code computes in float32 whatever the model's dtype:
# granite_swa and granitemoe_swa force their softmax and sink scaling to float32, flint
# its scores and softmax; their float64 forward is exact to float32's precision only.
# hrm_text's softmax (float32, as most eager attention code computes it) and norms
# (x.float()) run in float32 too, and each token passes through its stacks
# H_cycles * (L_cycles + 1) times: float32-sized steps compound past float64's
# tolerance over a few layers per stack, while its tokens stay transformers'.
FLOAT32_ATTENTION_MODEL_TYPES = frozenset({"granite_swa", "granitemoe_swa", "flint", "hrm_text"})


def _reference_dtype(runner: ModelRunner, config: PretrainedConfig) -> torch.dtype:
    """The dtype the model's own forward is exact to: the cache's, or float32 where a
    recurrent layer's own code or the model's attention code computes in float32 (and
    the cache's is wider)."""
    if runner.spec.dtype != torch.float64:
        return runner.spec.dtype
    if config.get_text_config().model_type in FLOAT32_ATTENTION_MODEL_TYPES:
        return torch.float32
    kinds = [m.kind for m in runner.model.modules() if isinstance(m, RecurrentLayer)]
    if any(k.reference_dtype == torch.float32 for k in kinds):
        return torch.float32
    return runner.spec.dtype


def _decode_differs_from_scan(model: nn.Module) -> bool:
    """Whether a recurrent layer's own code computes a continuing single token otherwise
    than its chunked scan would (a kind's ``decode_differs_from_scan``)."""
    return any(module.kind.decode_differs_from_scan(module.layer)
               for module in model.modules() if isinstance(module, RecurrentLayer))


def _record_layers(layers: nn.ModuleList, sink: dict[int, torch.Tensor]):
    """Forward hooks keeping each layer's output hidden states as [streams, T, hidden]:
    [1, T, hidden] for most layers, one row per stream where a layer passes several
    stacked ahead of the batch (gemma3n's AltUp: [streams, 1, T, hidden]) or beside each
    token (hyper-connections, hy_v4: [1, T, streams, hidden])."""
    def keep(index: int, output: object) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        assert isinstance(hidden, torch.Tensor), f"layer {index} returns no hidden-state tensor"
        if hidden.dim() == 4 and hidden.shape[0] == 1:  # AltUp's streams (more than one) lead instead
            hidden = hidden[0].transpose(0, 1)
        sink[index] = hidden.reshape(-1, *hidden.shape[-2:])

    def hook(index):
        return lambda module, args, output: keep(index, output)
    return [layer.register_forward_hook(hook(index)) for index, layer in enumerate(layers)]


def _pixel_inputs(request: Request) -> dict[str, torch.Tensor]:
    """The processor tensors of a request's images, batched as the model's forward takes them."""
    if not request.images:
        return {}
    keys = request.images[0].pixel_inputs
    pixels = {key: torch.cat([image.pixel_inputs[key] for image in request.images]) for key in keys}
    if request.images[0].grid is not None:  # M-RoPE: the model computes its ids from the image tokens' places
        token_types = torch.zeros(1, len(request.all_token_ids) - 1, dtype=torch.int64)
        for image in request.images:
            token_types[0, list(image.positions)] = 1
        pixels["mm_token_type_ids"] = token_types
    if request.images[0].bidirectional:  # Gemma 3 masks its image rows both ways by their token types
        token_types = torch.zeros(1, len(request.all_token_ids) - 1, dtype=torch.int64)
        for image in request.images:
            token_types[0, list(image.positions)] = 1
        pixels["token_type_ids"] = token_types
    return pixels


def _widest_image(prompt: ProcessedPrompt | None) -> int:
    """The most tokens one image of ``prompt`` needs in one step (an image attending both
    ways is computed whole), 0 for none."""
    images = prompt.images if prompt is not None else ()
    return max((image.end - image.start for image in images if image.bidirectional), default=0)


def _run_paged(runner: ModelRunner, layers: nn.ModuleList, prompts: list[list[int]],
               max_model_len: int, image_prompt: ProcessedPrompt | None = None) \
        -> tuple[list[Request], dict[str, _Trace]]:
    """The prompts through the engine's paged path, greedy; each request's trace."""
    num_blocks = runner.num_blocks
    num_slots = min(len(prompts), runner.num_state_slots)
    # Where the state slots hold one more than the probes, the rest a saved state.
    snapshots = 1 if runner.num_state_slots > num_slots else 0
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=len(prompts) + 1, max_num_batched_tokens=max(CHUNK_TOKENS, _widest_image(image_prompt)),
        max_model_len=max_model_len,
        block_size=runner.block_size, num_blocks=num_blocks, enable_prefix_caching=bool(snapshots),
        num_state_slots=num_slots, num_state_snapshots=snapshots, windowed=runner.windowed))
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0)
    requests = [Request(f"load-check-{i}", prompt, DECODE_STEPS, params=params) for i, prompt in enumerate(prompts)]
    if image_prompt is not None:
        requests.append(Request("load-check-image", image_prompt.prompt_token_ids, DECODE_STEPS, params=params,
                                images=image_prompt.images))
    for request in requests:
        scheduler.add_request(request)
    traces = {request.request_id: _Trace() for request in requests}
    outputs: dict[int, torch.Tensor] = {}
    hooks = _record_layers(layers, outputs)
    try:
        while scheduler.has_unfinished_requests():
            step = scheduler.schedule()
            inputs, plan = runner.prepare_inputs(step)
            if runner.lora_manager is not None:  # LoRA layers in place, no adapter in use
                runner.lora_manager.prepare_step([None] * len(step.scheduled),
                                                 [item.num_new_tokens for item in step.scheduled])
            keep = torch.tensor(plan.keep, dtype=torch.int64, device=runner.device)
            items = step.scheduled
            runner.copy_states([(item.restore_slot, item.state_slot) for item in items if item.restore_slot >= 0])
            logits = runner.model(**inputs, use_cache=False, logits_to_keep=keep).logits[0]
            runner.copy_states([(item.state_slot, item.save_slot) for item in items if item.save_slot >= 0])
            ctx = inputs["shardline_ctx"]
            # The last layer computes only the sampled rows where the backend attends them alone.
            last_rows = None if ctx.sampled_rows is None else set(ctx.sampled_rows.tolist())
            offset = 0
            for item in step.scheduled:
                trace = traces[item.request.request_id]
                for row in range(item.num_new_tokens):
                    position = item.start + row
                    for index, hidden in outputs.items():
                        if index == len(layers) - 1 and last_rows is not None and offset + row not in last_rows:
                            continue
                        trace.layers.setdefault(index, {})[position] = hidden[0, offset + row].float()
                if item.is_last_chunk:
                    row_logits = logits[plan.sample_rows[item.request.request_id]].float()
                    trace.logits[item.start + item.num_new_tokens - 1] = row_logits
                    item.request.append_output_token(int(row_logits.argmax()))
                    if item.request.num_output_tokens >= DECODE_STEPS:
                        scheduler.finish_requests(item.request.request_id, RequestStatus.FINISHED_LENGTH)
                offset += item.num_new_tokens
    finally:
        for hook in hooks:
            hook.remove()
        for request in requests:  # frees the blocks if the loop stopped early
            scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    return requests, traces


def _attention_implementations(config: PretrainedConfig) -> str | dict[str, str]:
    """The model's attention implementation, per sub-config where they differ (a
    vision-language model's text part attends the paged cache, its encoders do not)."""
    implementation = config._attn_implementation
    assert implementation is not None, "the loader names the model's attention implementation"
    sub_configs = {name: getattr(config, name, None) for name in getattr(config, "sub_configs", {})}
    per_part = {name: sub._attn_implementation for name, sub in sub_configs.items()
                if isinstance(sub, PretrainedConfig) and sub._attn_implementation is not None}
    if all(value == implementation for value in per_part.values()):
        return implementation
    return {"": implementation, **per_part}


def _compare(model: PreTrainedModel, layers: nn.ModuleList, token_ids: list[int], trace: _Trace, dtype: torch.dtype,
             architecture: str, num_prompt_tokens: int | None = None,
             pixel_inputs: dict[str, torch.Tensor] | None = None) -> None:
    """The model's own forward over ``token_ids`` against ``trace``; with
    ``num_prompt_tokens``, the prompt in one forward and each later token alone on the
    model's cache (as its generate runs them)."""
    outputs: dict[int, torch.Tensor] = {}
    hooks = _record_layers(layers, outputs)
    implementation = _attention_implementations(model.config)
    try:
        model.set_attn_implementation("eager")
        ids = torch.tensor([token_ids], device=next(model.parameters()).device)
        if num_prompt_tokens is None:
            pixels = {key: value.to(ids.device, model.dtype) if value.is_floating_point() else value.to(ids.device)
                      for key, value in (pixel_inputs or {}).items()}
            reference_logits = model(input_ids=ids, use_cache=False, **pixels).logits[0].float()
        else:
            reference_logits = _incremental_forward(model, ids, num_prompt_tokens, outputs)
    finally:
        model.set_attn_implementation(implementation)
        for hook in hooks:
            hook.remove()
    tolerance = max(TOLERANCES.get(dtype, 0.1), quantized_tolerance(model))
    for index in sorted(trace.layers):
        for position in sorted(trace.layers[index]):
            expected = outputs[index][0, position].float()
            if _differs(trace.layers[index][position], expected, tolerance):
                raise ModelMismatchError(
                    f"{architecture}: the engine's paged attention computes layer {index} "
                    f"({type(_unwrapped(layers[index])).__name__}) differently from the model's own forward, "
                    f"first at position {position} of a {len(token_ids)}-token probe; shardline cannot run "
                    f"this model exactly (LLM(..., check_model=False) skips this check at your own risk)")
    for position, logits in sorted(trace.logits.items()):
        if _differs(logits, reference_logits[position], tolerance):
            raise ModelMismatchError(
                f"{architecture}: the engine's logits differ from the model's own forward at position "
                f"{position} of a {len(token_ids)}-token probe (its layers agree: the difference is after "
                f"them); shardline cannot run this model exactly "
                f"(LLM(..., check_model=False) skips this check at your own risk)")


def _incremental_forward(model: PreTrainedModel, ids: torch.Tensor, num_prompt_tokens: int,
                         outputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """The prompt of ``ids`` [1, T] in one forward, then each later token alone on the
    model's own cache; ``outputs`` (filled by the layer hooks) ends holding each layer's
    outputs over all T positions. Returns the logits [T, V] in float32."""
    result = model(input_ids=ids[:, :num_prompt_tokens], use_cache=True)
    cache = result.cache
    logits, layer_outputs = [result.logits[0].float()], {index: [hidden] for index, hidden in outputs.items()}
    for position in range(num_prompt_tokens, ids.shape[1]):
        result = model(input_ids=ids[:, position:position + 1], cache=cache, use_cache=True)
        cache = result.cache
        logits.append(result.logits[0].float())
        for index, hidden in outputs.items():
            layer_outputs[index].append(hidden)
    outputs.update({index: torch.cat(parts, dim=1) for index, parts in layer_outputs.items()})
    return torch.cat(logits)


def _differs(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    scale = float(expected.abs().max()) + 1e-30
    return not bool(torch.isfinite(actual).all()) or float((actual - expected).abs().max()) > tolerance * scale


def _unwrapped(layer: nn.Module) -> nn.Module:
    """The transformers layer behind an engine replacement (its ``layer``), else itself."""
    inner = getattr(layer, "layer", None)
    return inner if isinstance(inner, nn.Module) else layer
