"""The rank processes of a tensor-parallel engine.

Rank 0 is the engine's own process: it runs the scheduler, samples, and drives the
others through a ``RankDriver``. It starts ranks 1..N-1 itself (spawned processes; no
launcher needed), each of which builds the same engine parts on its shard of the model
(the load check's forwards run on every rank at once) and then follows rank 0: per
step, a small layout message on its pipe, then the step's packed integer inputs in one
broadcast (token ids may be on the device, sampled by the step before), and the same
forward; block and state copies arrive as messages.

Faults: a rank that exits or stops answering fails rank 0's next collective (gloo sees
the closed connection, or the collective times out), which raises TensorParallelError
naming the rank and its exit code. A rank exits when rank 0's pipe closes, so none
outlives the engine's process; ``close`` stops them and kills any that do not stop.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] - public, not in __all__

from ..attention.backends import StepBatch
from ..config import EngineConfig
from ..cpu.paths import PATH_NAMES, CpuPaths
from ..model.loader import resolve_device
from ..model.runner import ModelInputs, ModelRunner
from ..multimodal.qwen_vl import DEEPSTACK_KEY
from ..recurrent.state import RecurrentStep
from .group import RankGroup, TensorParallelError, collective_timeout, join_group, leave_group
from .vlm import deepstack_layout, received_deepstack, stacked_deepstack

logger = logging.getLogger(__name__)

STEP, MIRROR, STOP, READY, FAILED = "step", "mirror", "stop", "ready", "failed"
# The runner methods rank 0 has every rank call too: the cache copies, and a step's
# LoRA adapters and token slots (each rank loads its share of the adapters).
MIRRORED = ("copy_blocks", "copy_block_prefixes", "copy_states", "prepare_lora_step")
# Forwards a rank runs from one message instead of a step's broadcast inputs: an
# embedding model's packed batch (engine/pooling/ranks.py).
MIRRORED_FORWARDS = ("pool_forward",)
STOP_GRACE_S = 10.0
_T = TypeVar("_T")


class MirroredForwards(Protocol):
    """A rank's model run only through MIRRORED_FORWARDS (an embedding model's shard)."""

    def pool_forward(self, batch: Any) -> None: ...


class BuildRunner(Protocol):
    """Builds a rank's runner: the engine parts on this rank's shard (parts/build.py),
    or an embedding model's shard (engine/pooling/ranks.py)."""

    def __call__(self, config: EngineConfig, ranks: RankGroup) -> ModelRunner | MirroredForwards: ...


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a step's packed int64 buffer splits back into its tensors: per tensor its
    key, shape and dtype; the StepBatch's fields as a tree whose leaves are tensor keys
    or constants; and whether every position's logits are kept."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    batch: dict[str, Any]
    has_state: bool
    has_prompt_counts: bool
    keep_all: bool
    # A vision-language model's step with images: the input embeddings' shape and dtype,
    # broadcast after the integers (engine/parallel/vlm.py); None: the ids suffice.
    embeds: tuple[tuple[int, ...], torch.dtype] | None = None
    # A Qwen3-VL step with images: its deepstack rows stacked [layers, rows, H], broadcast
    # after the embeddings (their positions' mask travels with the integers); None: none.
    deepstack: tuple[tuple[int, ...], torch.dtype] | None = None

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, shape, _ in self.tensors)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def pack_step(model_inputs: ModelInputs, keep: torch.Tensor | int) -> tuple[StepLayout, torch.Tensor]:
    """A step's inputs as a layout (to pickle) and one flat int64 tensor (to broadcast);
    a step with images' input embeddings go apart (``RankDriver.run_step``)."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(key: str, value: object) -> object:
        if isinstance(value, torch.Tensor):
            tensors[key] = value
            return ("tensor", key)
        if isinstance(value, tuple):
            return ("tuple", tuple(encode(f"{key}.{i}", item) for i, item in enumerate(value)))
        return ("constant", value)

    ctx = model_inputs["shardline_ctx"]
    batch = {field.name: encode(f"batch.{field.name}", getattr(ctx, field.name))
             for field in dataclasses.fields(StepBatch) if field.name != "kv_caches"}
    input_ids, embeds = model_inputs.get("input_ids"), model_inputs.get("inputs_embeds")
    deepstack = model_inputs.get(DEEPSTACK_KEY)
    if deepstack is not None:
        tensors["deepstack.mask"] = deepstack.mask
    if input_ids is not None:
        tensors["input_ids"] = input_ids
    tensors["position_ids"] = model_inputs["position_ids"]
    state = model_inputs.get("shardline_state")
    if state is not None:
        tensors["state.slots"], tensors["state.has_initial_state"] = state.slots, state.has_initial_state
        if state.num_prompt_tokens is not None:
            tensors["state.num_prompt_tokens"] = state.num_prompt_tokens
    if isinstance(keep, torch.Tensor):
        tensors["keep"] = keep
    assert all(not t.is_floating_point() for t in tensors.values()), "a step's inputs are integers"
    layout = StepLayout(tuple((key, tuple(t.shape), t.dtype) for key, t in tensors.items()), batch,
                        state is not None, state is not None and state.num_prompt_tokens is not None,
                        not isinstance(keep, torch.Tensor),
                        None if embeds is None else (tuple(embeds.shape), embeds.dtype),
                        None if deepstack is None else deepstack_layout(deepstack))
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors.values()])
    return layout, flat


def unpack_step(layout: StepLayout, flat: torch.Tensor, runner: ModelRunner, embeds: torch.Tensor | None = None,
                deepstack: torch.Tensor | None = None) -> tuple[ModelInputs, torch.Tensor | int]:
    """The model inputs of a step on this rank: ``flat`` split by ``layout``, over this
    rank's caches and recurrent states (``embeds``: a step with images' input embeddings)."""
    tensors, offset = {}, 0
    for key, shape, dtype in layout.tensors:
        count = _numel(shape)
        tensors[key] = flat[offset : offset + count].view(shape).to(dtype)
        offset += count

    def decode(node: Any) -> Any:
        kind, value = node
        if kind == "tensor":
            return tensors[value]
        return tuple(decode(item) for item in value) if kind == "tuple" else value

    batch = StepBatch(kv_caches=runner.kv_caches, **{name: decode(node) for name, node in layout.batch.items()})
    inputs = ModelInputs(position_ids=tensors["position_ids"], shardline_ctx=runner.attention.build_context(batch))
    if deepstack is not None:
        inputs[DEEPSTACK_KEY] = received_deepstack(runner.model, tensors["deepstack.mask"], deepstack)  # type: ignore[literal-required]
    if embeds is not None:
        inputs["inputs_embeds"] = embeds
    else:
        inputs["input_ids"] = tensors["input_ids"]
    if layout.has_state:
        inputs["shardline_state"] = RecurrentStep(
            slots=tensors["state.slots"], has_initial_state=tensors["state.has_initial_state"],
            states=runner.recurrent_states,
            num_prompt_tokens=tensors["state.num_prompt_tokens"] if layout.has_prompt_counts else None)
    return inputs, 0 if layout.keep_all else tensors["keep"]


class RankDriver:
    """Rank 0's side: starts ranks 1..N-1 (``build`` makes each one's runner), joins the
    group with them, and sends them each step (the runner's StepFollowers)."""

    def __init__(self, config: EngineConfig, build: BuildRunner) -> None:
        self.size = config.tensor_parallel_size
        device_type = resolve_device(config.device).type
        if device_type == "cuda" and torch.cuda.device_count() < self.size:
            raise TensorParallelError(f"tensor_parallel_size={self.size} needs {self.size} CUDA devices; "
                                      f"this host has {torch.cuda.device_count()}")
        context = multiprocessing.get_context("spawn")
        store = TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=collective_timeout(),
                              wait_for_workers=False)
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.reports: dict[int, str] = {}
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_rank, args=(rank, config, store.port, theirs, build),
                                      name=f"shardline-tp-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        threads = share_cpu_threads(self.size) if device_type == "cpu" else None
        self._finalizer = weakref.finalize(self, stop_ranks, self.processes, self.pipes, threads)
        try:
            join_group(store, 0, self.size, device_type)
        except BaseException:
            self.close()
            raise
        self.group = RankGroup(0, self.size, self.explain)

    def wait_ready(self) -> None:
        """Wait until every rank has built its parts; TensorParallelError naming the
        first that failed instead."""
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(collective_timeout().total_seconds()):
                raise TensorParallelError(f"tensor-parallel rank {rank} did not finish loading: {self.explain()}")
            self._read(rank, pipe)
            if rank in self.reports:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {self.reports[rank]}")

    def explain(self) -> str:
        """Which ranks have failed and how (exit codes, their own reports)."""
        for rank, pipe in enumerate(self.pipes, start=1):
            self._read(rank, pipe)
        problems = []
        for rank, process in enumerate(self.processes, start=1):
            if rank in self.reports:
                problems.append(f"rank {rank} failed: {self.reports[rank]}")
            elif not process.is_alive():
                problems.append(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
        return "; ".join(problems) or f"no rank of {self.size} has exited; one stopped answering"

    def _read(self, rank: int, pipe: multiprocessing.connection.Connection) -> None:
        try:
            while pipe.poll():
                kind, payload = pipe.recv()
                if kind == FAILED:
                    self.reports[rank] = payload
        except (EOFError, OSError):
            pass

    def _send(self, message: tuple[str, object]) -> None:
        if self.group.failure is not None:
            raise TensorParallelError(self.group.failure)
        for pipe in self.pipes:
            try:
                pipe.send(message)
            except (BrokenPipeError, OSError) as error:
                self.group.failure = f"tensor-parallel group of {self.size} ranks stopped: {self.explain()}"
                raise TensorParallelError(self.group.failure) from error

    def run_step(self, model_inputs: ModelInputs, keep: torch.Tensor | int, forward: Callable[[], _T]) -> _T:
        """Send the step's inputs to every rank, then run this rank's ``forward`` beside
        theirs. A forward that raises here leaves the other ranks inside the step's
        collectives, out of step with the next: the group is failed, and every later
        step raises at once."""
        layout, flat = pack_step(model_inputs, keep)
        self._send((STEP, layout))
        self.group.broadcast(flat)
        embeds = model_inputs.get("inputs_embeds")
        if embeds is not None:
            self.group.broadcast(embeds.contiguous())
        if layout.deepstack is not None:
            self.group.broadcast(stacked_deepstack(model_inputs[DEEPSTACK_KEY]))  # type: ignore[literal-required]
        return self._beside(forward)

    def run_mirrored(self, method: str, args: tuple[Any, ...], forward: Callable[[], _T]) -> _T:
        """Have every rank call ``method`` (one of MIRRORED_FORWARDS) with ``args``, a
        forward of its shard, then run this rank's ``forward`` beside theirs (failing
        the group as ``run_step`` does)."""
        assert method in MIRRORED_FORWARDS, f"{method!r} is not a forward the ranks mirror"
        self._send((MIRROR, (method, args)))
        return self._beside(forward)

    def _beside(self, forward: Callable[[], _T]) -> _T:
        try:
            return forward()
        except BaseException as error:
            if self.group.failure is None:
                self.group.failure = (f"tensor-parallel group of {self.size} ranks stopped: rank 0's forward raised "
                                      f"{type(error).__name__}: {error}; the other ranks are out of step with it")
            raise

    def mirror(self, method: str, *args: Any) -> None:
        """Have every rank's runner call ``method`` (one of MIRRORED) with ``args``."""
        assert method in MIRRORED, f"{method!r} is not a runner method the ranks mirror"
        self._send((MIRROR, (method, args)))

    def close(self) -> None:
        """Stop every rank (killing those that do not stop) and leave the group."""
        self._finalizer()


def share_cpu_threads(size: int) -> int:
    """On CPU, give each of ``size`` ranks an equal share of the cores torch would use
    (the ranks compute at once; more threads than cores slow every rank); return the
    thread count before (rank 0's process gets it back when the group closes)."""
    before = torch.get_num_threads()
    threads = max(1, before // size)
    logger.info("tensor-parallel rank process takes %d of torch's %d CPU threads", threads, before)
    torch.set_num_threads(threads)
    return before


# The CPU paths a split model runs as the whole one does: packed linears (each rank's
# share packed; a row-split linear's sum stays outside them), the attention kernels on
# each rank's heads and cache, the quantized kernels on each share. Not the fused
# decoder layers and MLPs (they read the projections whole and would skip the ranks'
# sums) nor a hybrid's CPU layers.
RANK_CPU_PATHS = ("packed_linears", "decode_kernel", "prefill_kernel", "quant_kernels")


def rank_cpu_paths(paths: CpuPaths, group: RankGroup, hybrid: bool) -> CpuPaths:
    """The CPU paths every rank of ``group`` takes: rank 0's choice among
    RANK_CPU_PATHS (broadcast, so every rank replaces the same modules and runs the same
    collectives), none for a ``hybrid`` (recurrent layers) model. Every rank calls it."""
    names = () if hybrid else RANK_CPU_PATHS
    chosen = group.broadcast(torch.tensor([int(getattr(paths, name)) for name in RANK_CPU_PATHS], dtype=torch.int64))
    taken = {name: bool(value) and name in names for name, value in zip(RANK_CPU_PATHS, chosen.tolist())}
    why_off = ("a hybrid model's CPU layers are not run over tensor-parallel ranks" if hybrid else
               "not taken over tensor-parallel ranks: its fused layers read the split projections whole")
    reasons = tuple((name, why if name in names else why_off) for name, why in paths.reasons)
    return dataclasses.replace(paths, **{**dict.fromkeys(PATH_NAMES, False), **taken}, reasons=reasons,
                               packed_dtype=paths.packed_dtype if taken["packed_linears"] else None)


def stop_ranks(processes: list[multiprocessing.process.BaseProcess],
               pipes: list[multiprocessing.connection.Connection], threads: int | None = None) -> None:
    """Ask each rank to stop, then kill any still running after STOP_GRACE_S; give rank
    0's process back its ``threads`` (None: left as they are)."""
    for pipe in pipes:
        try:
            pipe.send((STOP, None))
        except (BrokenPipeError, OSError):
            pass
    for process in processes:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            logger.warning("tensor-parallel rank %s did not stop; killing it", process.name)
            process.kill()
            process.join(STOP_GRACE_S)
    for pipe in pipes:
        pipe.close()
    leave_group()
    if threads is not None:
        torch.set_num_threads(threads)


def run_rank(rank: int, config: EngineConfig, port: int, pipe: multiprocessing.connection.Connection,
             build: BuildRunner) -> None:
    """A rank process's main: join the group, build this rank's runner, follow rank 0."""
    try:
        store = TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                              timeout=collective_timeout())
        device_type = resolve_device(config.device).type
        if device_type == "cpu":
            share_cpu_threads(config.tensor_parallel_size)
        join_group(store, rank, config.tensor_parallel_size, device_type)
        group = RankGroup(rank, config.tensor_parallel_size, lambda: "rank 0 or another rank stopped")
        runner = build(config, group)
        pipe.send((READY, None))
        follow(runner, group, pipe)
    except Exception as error:  # reported to rank 0, which names it in its error
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            pipe.send((FAILED, f"{type(error).__name__}: {error}"))
        except (BrokenPipeError, OSError):
            pass
        sys.exit(1)
    finally:
        leave_group()


def follow(runner: ModelRunner | MirroredForwards, group: RankGroup,
           pipe: multiprocessing.connection.Connection) -> None:
    """Run rank 0's steps and copies on this rank's shard until it says stop or its pipe
    closes (rank 0's process is gone)."""
    while True:
        try:
            kind, payload = pipe.recv()
        except (EOFError, OSError):
            return
        if kind == STOP:
            return
        if kind == STEP:
            assert isinstance(runner, ModelRunner), type(runner)
            run_step(runner, group, payload)
        else:
            method, args = payload
            assert kind == MIRROR and method in MIRRORED + MIRRORED_FORWARDS, (kind, method)
            getattr(runner, method)(*args)


@torch.inference_mode()
def run_step(runner: ModelRunner, group: RankGroup, layout: StepLayout) -> None:
    """This rank's forward of one step: its inputs from rank 0's broadcast."""
    flat = group.broadcast(torch.empty(layout.numel, dtype=torch.int64, device=runner.device))
    embeds = None
    if layout.embeds is not None:
        shape, dtype = layout.embeds
        embeds = group.broadcast(torch.empty(shape, dtype=dtype, device=runner.device))
    deepstack = None
    if layout.deepstack is not None:
        shape, dtype = layout.deepstack
        deepstack = group.broadcast(torch.empty(shape, dtype=dtype, device=runner.device))
    model_inputs, keep = unpack_step(layout, flat, runner, embeds, deepstack)
    runner.model(**model_inputs, use_cache=False, logits_to_keep=keep)
