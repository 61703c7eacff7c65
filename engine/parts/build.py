"""Building an engine's parts from its config and loaded model.

``build_engine_parts`` makes everything LLMEngine drives, in one written order:
the model is loaded, then prepared (``prepare_engine_model``: the CPU paths this host
takes are chosen, then the one module-surgery step, engine/surgery.py's
``prepare_model``, makes the engine's replacements in its PREPARATION_ORDER:
attention adapters, quantized linears, tensor-parallel shards, LoRA, recurrent layers, CPU layers; then the
attention backend is
chosen, once), then the KV cache is planned from what memory is left (after LoRA's
adapter slots), then the runner (with its LoRA manager), its CUDA graphs, the
scheduler and the load-time check; last the sampling side (sampler, reasoning
parser, output processor, structured-output manager). With tensor_parallel_size N, rank 0
(this process) starts ranks 1..N-1 (engine/parallel/ranks.py), every rank builds the
same parts on its shard, and rank 0's runner sends the others each step. The pooling engine shares
``resolve_for_device`` and ``resolve_max_model_len``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..attention.backends import AttentionBackend, choose_attention_backend
from ..config import EngineConfig
from ..core.scheduler import Scheduler, SchedulerConfig
from ..cpu.capability import ModelShape
from ..cpu.memory import keep_freed_memory, release_freed_memory
from ..cpu.paths import (
    NO_CPU_PATHS,
    CpuPaths,
    CpuRewrites,
    choose_cpu_paths,
    choose_recurrent_paths,
    optimize_for_cpu,
)
from ..lora.manager import LoRAManager
from ..model.adapters import adapt_attention
from ..model.adapters.deepseek_v4 import COMPRESSED_MODEL_TYPES
from ..model.adapters.inkling import INKLING_TYPES
from ..model.adapters.latent import selects_keys
from ..model.kv_cache_spec import KVCacheSpec, first_attention_heads, plan_windowed_blocks
from ..model.layer_kinds import recurrent_layer_indices
from ..model.load_check import check_model
from ..model.loader import LoadedModel, load_causal_lm, load_hf_config
from ..model.profiling import profile_peak_bytes
from ..model.runner import DEFAULT_CPU_KV_CACHE_BYTES, ModelRunner, model_max_len, plan_kv_cache
from ..multimodal.encoder_cache import EncoderCache
from ..multimodal.processor import MultimodalProcessor
from ..parallel.group import RankGroup
from ..parallel.loading import RankCheckpoint, SliceReader
from ..parallel.placement import shard_then_place
from ..parallel.ranks import RankDriver, rank_cpu_paths
from ..parallel.sharding import shard_cache_spec
from ..parallel.verdict import tensor_parallel_verdict
from ..quantization.load import put_quantized_linears
from ..recurrent.state import RecurrentStateSpec, prepare_recurrent_layers
from ..sampling.harmony import HarmonyParser
from ..sampling.output_processor import OutputProcessor
from ..sampling.reasoning import ReasoningParser, make_reasoning_parser
from ..sampling.sampler import Sampler
from ..sampling.structured import StructuredOutputManager
from ..surgery import Preparation, prepare_model
from ..tools import ToolCallParser, tool_parser_for

logger = logging.getLogger(__name__)


@dataclass
class EngineModel:
    """What preparing a loaded model for the engine made: its per-layer cache spec, the
    recurrent layers' state spec (None without them), the LoRA manager (None without
    enable_lora), the CPU fast paths taken and the modules they replaced, and the
    attention backend."""

    spec: KVCacheSpec
    state_spec: RecurrentStateSpec | None
    lora_manager: LoRAManager | None
    cpu_paths: CpuPaths
    cpu_rewrites: CpuRewrites
    attention: AttentionBackend
    ranks: RankGroup | None = None  # this rank's tensor-parallel group, None on one rank


@dataclass
class EngineParts:
    """Everything a generation engine drives, built by ``build_engine_parts``."""

    config: EngineConfig
    loaded: LoadedModel
    vocab_size: int
    max_model_len: int
    prepared: EngineModel
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler
    reasoning_parser: ReasoningParser | HarmonyParser | None
    tool_parser: ToolCallParser | None  # reads requests' tool calls (engine/tools/)
    output_processor: OutputProcessor
    structured: StructuredOutputManager
    # A vision-language model's processor step (None for a text-only model).
    multimodal: MultimodalProcessor | None = None


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None,
                       ranks: RankGroup | None = None) -> EngineParts:
    """Load (unless ``loaded`` is given) and prepare the model, plan its KV cache and
    build the runner, scheduler and sampling parts, in the order the module states.
    ``ranks``: this process's tensor-parallel group (None: rank 0 starts one where
    tensor_parallel_size asks for it)."""
    if ranks is None and config.tensor_parallel_size > 1:
        return build_rank_zero_parts(config, loaded)
    # A tensor-parallel rank reads only its slices of the split weights (engine/parallel/loading.py).
    reader = SliceReader() if ranks is not None and loaded is None else None
    loaded = loaded or load_causal_lm(config, reader)
    config = resolve_for_device(config, loaded.device)
    vocab_size = int(loaded.hf_config.get_text_config().vocab_size)
    prepared = prepare_engine_model(config, loaded, ranks, reader.checkpoint if reader is not None else None)
    runner, scheduler = build_runner_and_scheduler(config, loaded, prepared)
    multimodal = MultimodalProcessor.load(config, loaded.hf_config)  # a vision-language model's, else None
    if multimodal is not None:
        runner.encoder_cache = EncoderCache(loaded.model, multimodal.spec)
    max_model_len = scheduler.config.max_model_len
    if config.check_model:
        image_prompt = multimodal.load_check_prompt(vocab_size) if multimodal is not None else None
        check_model(runner, vocab_size, max_model_len, type(loaded.model).__name__, image_prompt)
    if multimodal is not None:  # a fresh encoder cache: the check's image forgotten, no runs counted
        runner.encoder_cache = EncoderCache(loaded.model, multimodal.spec)
    reasoning_parser = (make_reasoning_parser(config.reasoning_parser, loaded.tokenizer)
                        if config.reasoning_parser is not None else None)
    tool_parser = tool_parser_for(config.tool_call_parser, loaded.tokenizer)
    output_processor = OutputProcessor(loaded.tokenizer, eos_token_ids(loaded), max_model_len, reasoning_parser,
                                       tool_parser)
    return EngineParts(
        config=config, loaded=loaded, vocab_size=vocab_size, max_model_len=max_model_len, prepared=prepared,
        runner=runner, scheduler=scheduler, sampler=Sampler(config.seed), reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
        output_processor=output_processor,
        structured=StructuredOutputManager(loaded.tokenizer, vocab_size, output_processor.eos_token_ids),
        multimodal=multimodal,
    )


def build_rank_zero_parts(config: EngineConfig, loaded: LoadedModel | None) -> EngineParts:
    """Rank 0 of a tensor-parallel engine: refuse what the ranks cannot split (before any
    starts), start the other ranks, build this rank's parts beside theirs and hand its
    runner the driver that sends them each step. The ranks are stopped if any fails."""
    tensor_parallel_verdict(loaded.hf_config if loaded is not None else load_hf_config(config),
                            config.tensor_parallel_size, quantization=config.quantization, task=config.task,
                            trust_remote_code=config.trust_remote_code)
    driver = RankDriver(config, build_rank_runner)
    try:
        parts = build_engine_parts(config, loaded, driver.group)
        driver.wait_ready()
    except BaseException:
        driver.close()
        raise
    parts.runner.followers = driver
    return parts


def build_rank_runner(config: EngineConfig, ranks: RankGroup) -> ModelRunner:
    """The runner of a tensor-parallel rank other than 0 (its process's main builds it)."""
    return build_engine_parts(config, ranks=ranks).runner


def resolve_for_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """``config`` with the options left to the device (the token budget) filled in."""
    return config.with_token_budget(device.type)


def token_budget(config: EngineConfig) -> int:
    """A config's tokens per step, once ``resolve_for_device`` has filled it in."""
    assert config.max_num_batched_tokens is not None, "the config is not resolved for its device"
    return config.max_num_batched_tokens


def prepare_engine_model(config: EngineConfig, loaded: LoadedModel, ranks: RankGroup | None = None,
                         checkpoint: RankCheckpoint | None = None) -> EngineModel:
    """Every change to the loaded model before its cache is planned: the CPU paths this
    host takes are chosen (``choose_host_paths``), the engine's replacements are made
    by the one surgery step (engine/surgery.py's ``prepare_model``, in its
    PREPARATION_ORDER, over ``engine_preparation``), then the one attention backend the
    runner, the CPU layers and the CUDA-graph path ask is chosen, on the prepared model
    (an adapter may attend with a position bias only the torch path takes). ``checkpoint``:
    where a tensor-parallel rank reads the slices of the parameters its loader left unread."""
    spec = KVCacheSpec.from_hf_config(loaded.hf_config, loaded.dtype)
    num_heads = first_attention_heads(loaded.hf_config)
    cpu_paths = choose_host_paths(config, loaded, spec, num_heads)
    if ranks is not None and cpu_paths is not None:  # rank 0's choice of those a split model runs
        cpu_paths = rank_cpu_paths(cpu_paths, ranks, hybrid=bool(recurrent_layer_indices(loaded.hf_config)))
    num_attention_layers = sum(1 for layer in spec.layers if layer.num_kv_heads)
    if ranks is not None:
        spec, num_heads = shard_cache_spec(spec, loaded.hf_config, ranks.size), max(1, num_heads // ranks.size)
    # A rank's model arrives on the CPU (loader.py): the sharding step splits it, then moves its shard.
    # A rank reads a quantized checkpoint's split linears as shares in the sharding step (quantized_slices.py).
    sliced = loaded.quantized if ranks and loaded.quantized is not None and not loaded.quantized.scheme.online else None
    sharding = (partial(shard_then_place, group=ranks, num_attention_layers=num_attention_layers,
                        device=loaded.device, checkpoint=checkpoint, quantized=sliced) if ranks else None)
    preparation = engine_preparation(config, loaded, cpu_paths, sharding)
    if sliced is not None:
        preparation = dataclasses.replace(preparation, quantized_linears=None)
    prepared = prepare_model(loaded.model, preparation)
    if loaded.quantized is not None and loaded.device.type == "cpu":
        release_freed_memory()  # the quantized linears' conversion temporaries (engine/quantization/)
    taken = cpu_paths or NO_CPU_PATHS
    attention = choose_attention_backend(
        config.attention_backend, loaded.device, loaded.dtype, num_heads,
        native_decode=taken.decode_kernel, native_prefill=taken.prefill_kernel,
        chunk_sizes=spec.chunk_sizes, position_bias=uses_position_bias(loaded.model))
    rewrites = CpuRewrites() if prepared.cpu_layers is None else prepared.cpu_layers
    return EngineModel(spec, prepared.recurrent_layers, prepared.lora, taken, rewrites, attention, ranks)


def choose_host_paths(config: EngineConfig, loaded: LoadedModel, spec: KVCacheSpec,
                      num_heads: int) -> CpuPaths | None:
    """The CPU fast paths this host takes for the model (engine/cpu/paths.py), or None
    where the engine takes none (off CPU); a model without attention layers takes its
    recurrent kernels' path alone.
    Chosen on the model as loaded, before the surgery: the shapes it measures are its
    linears', which every step keeps (adapters take over the projections under their
    names, LoRA and the recurrent layers wrap them)."""
    if loaded.device.type != "cpu":
        return None
    keep_freed_memory()
    first_attention = next((layer for layer in spec.layers if layer.num_kv_heads), None)
    if first_attention is None:  # recurrent layers only (Mamba, RWKV, xLSTM): their kernels' path alone
        return choose_recurrent_paths(loaded.dtype)
    shape = ModelShape.of(loaded.model, num_heads, first_attention.num_kv_heads, first_attention.head_dim)
    return choose_cpu_paths(loaded.dtype, shape, token_budget(config), enforce_eager=config.enforce_eager)


def engine_preparation(config: EngineConfig, loaded: LoadedModel, cpu_paths: CpuPaths | None,
                       sharding: Callable[[torch.nn.Module], int] | None = None) -> Preparation:
    """The engine's steps of the module surgery, which ``prepare_model`` runs in
    PREPARATION_ORDER: the attention adapters, the quantized linears (for a quantized
    checkpoint or online quantization), LoRA's wrappers (with enable_lora), the
    recurrent layers with per-request state slots (refusing a model whose recurrent
    layer got none), and the CPU paths' replacements (where ``cpu_paths`` were chosen);
    ``sharding``: a tensor-parallel rank's split of the model (engine/parallel/).
    The adapters are installed here, on the model already on its device (their
    originals keep their device buffers), not by the loader: every replacement is a
    step of this one preparation."""
    lora = (partial(LoRAManager, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                    device=loaded.device, dtype=loaded.dtype) if config.enable_lora else None)
    cpu_layers = (partial(optimize_for_cpu, paths=cpu_paths, rows_hint=token_budget(config))
                  if cpu_paths is not None else None)
    quantized = (partial(put_quantized_linears, weights=loaded.quantized)
                 if loaded.quantized is not None else None)
    return Preparation(
        attention_adapters=adapt_attention, quantized_linears=quantized, tensor_parallel=sharding, lora=lora,
        recurrent_layers=partial(prepare_recurrent_layers, recurrent_layers=recurrent_layer_indices(loaded.hf_config)),
        cpu_layers=cpu_layers)


def build_runner_and_scheduler(config: EngineConfig, loaded: LoadedModel,
                               prepared: EngineModel) -> tuple[ModelRunner, Scheduler]:
    """Plan the KV cache (blocks and recurrent-state slots) from the memory left, then
    build the runner over it (with CUDA graphs where they replay) and the scheduler."""
    spec, attention = prepared.spec, prepared.attention
    model_len = resolve_max_model_len(config, model_max_len(loaded.hf_config))
    budget = kv_cache_budget(config, loaded.device, loaded.model, attention, spec, model_len)
    if prepared.ranks is not None:  # every rank holds the same blocks and slots
        budget = prepared.ranks.min_int(budget)
    num_blocks, num_state_slots = plan_kv_cache(config, spec, model_len, budget, prepared.state_spec)
    windowed = None
    if config.free_windowed_blocks and not num_state_slots:  # hybrids keep one table (state snapshots)
        planned = plan_windowed_blocks(spec, config.block_size, config.max_num_seqs, model_len, token_budget(config),
                                       budget)
        if planned is not None:
            num_blocks, windowed = planned
    num_snapshots, num_blocks = plan_state_snapshots(config, spec, prepared.state_spec, model_len, budget,
                                                     num_blocks, num_state_slots)
    max_model_len = min(model_len, num_blocks * config.block_size)
    # The runner's state tensors hold the requests' slots, then the snapshots'.
    runner = ModelRunner(loaded.model, spec, num_blocks, config.block_size, loaded.device, attention,
                         prepared.state_spec, num_state_slots + num_snapshots, lora_manager=prepared.lora_manager,
                         windowed=windowed)
    if (loaded.device.type == "cuda" and not config.enforce_eager and prepared.lora_manager is None
            # Not over ranks: a replayed graph's collectives skip RankGroup's bounded waits and
            # failure mapping (a dead rank would hang the replay until NCCL's watchdog), and
            # capturing NCCL collectives in step on every rank has no multi-GPU host to test it.
            and prepared.ranks is None
            and attention.replays_decode_graphs and not num_state_slots and windowed is None
            and not selects_keys(loaded.hf_config.get_text_config())  # selections read on the host
            and loaded.hf_config.get_text_config().model_type not in COMPRESSED_MODEL_TYPES  # pooled per request
            and loaded.hf_config.get_text_config().model_type not in INKLING_TYPES):  # per request, on the host
        runner.enable_decode_graphs(config.max_num_seqs, max_model_len, capture=True)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=num_state_slots or config.max_num_seqs,
        max_num_batched_tokens=token_budget(config),
        max_model_len=max_model_len,
        max_loras=config.max_loras if config.enable_lora else None,
        block_size=config.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching and (num_snapshots > 0 or not num_state_slots),
        num_state_slots=num_state_slots,
        num_state_snapshots=num_snapshots,
        prefix_aware_admission=config.prefix_aware_admission,
        windowed=windowed,
    ))
    return runner, scheduler


def uses_position_bias(model: torch.nn.Module) -> bool:
    """Whether some attention layer attends with a bias table by key position (an
    adapter's ``uses_position_bias``), which only the torch attention path takes."""
    return any(getattr(module, "uses_position_bias", False) for module in model.modules())


# The share of the cache budget recurrent-state snapshots may take.
SNAPSHOT_BUDGET_FRACTION = 0.25


def plan_state_snapshots(config: EngineConfig, spec: KVCacheSpec, state_spec: RecurrentStateSpec | None,
                         model_len: int, budget: int, num_blocks: int, num_state_slots: int) -> tuple[int, int]:
    """(recurrent-state snapshot slots, KV blocks left) for prefix caching with recurrent
    layers, where a cached prefix continues only from the state saved after it
    (core/state_slots.py StateSnapshots). Up to max_num_seqs snapshots take the budget
    the plan left unused, then KV blocks, keeping those one request of ``model_len``
    needs and at most SNAPSHOT_BUDGET_FRACTION of the budget. No snapshot (and prefix
    caching off, with a warning) where not one fits; none without recurrent layers."""
    if not config.enable_prefix_caching or not num_state_slots:
        return 0, num_blocks
    assert state_spec is not None, "recurrent-state slots without a state spec"
    per_slot, per_block = state_spec.bytes_per_slot(), spec.bytes_per_block(config.block_size)
    unused = max(0, budget - num_state_slots * per_slot - num_blocks * per_block)
    spare_blocks = max(0, num_blocks - (math.ceil(model_len / config.block_size) + 1))
    spare = min(unused + spare_blocks * per_block, int(budget * SNAPSHOT_BUDGET_FRACTION))
    num_snapshots = min(config.max_num_seqs, spare // per_slot)
    if num_snapshots == 0:
        logger.warning("prefix caching is off: the cache budget of %d bytes leaves no room for a recurrent-state "
                       "snapshot of %d bytes beside the requests' states and KV blocks", budget, per_slot)
        return 0, num_blocks
    taken = max(0, num_snapshots * per_slot - unused)
    return num_snapshots, num_blocks - (math.ceil(taken / per_block) if per_block else 0)


def resolve_max_model_len(config: EngineConfig, limit: int) -> int:
    """The model's maximum length ``limit``, or the user's max_model_len if within it."""
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's maximum length {limit}")
    return config.max_model_len


def kv_cache_budget(config: EngineConfig, device: torch.device, model: torch.nn.Module,
                    attention: AttentionBackend, spec: KVCacheSpec, model_len: int) -> int:
    """Bytes for the KV cache: kv_cache_memory_bytes if set; on CPU a default; on
    CUDA gpu_memory_utilization of the device, less what the model uses at peak."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    _, total = torch.cuda.mem_get_info(device)
    peak = profile_peak_bytes(model, attention, spec, token_budget(config), config.block_size, device, model_len)
    return int(total * config.gpu_memory_utilization) - peak


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """EOS ids from the tokenizer and the model's generation_config."""
    ids: set[int] = set()
    tokenizer_eos = loaded.tokenizer.eos_token_id
    if isinstance(tokenizer_eos, int):
        ids.add(tokenizer_eos)
    gen_eos = getattr(loaded.generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(t) for t in gen_eos)
    return ids
