"""One rank's place in a tensor-parallel group and the collectives its layers call.

The group is torch.distributed's default process group of the rank's process: gloo on
CPU, NCCL on CUDA, each collective bounded by ``collective_timeout()`` so a rank that stops
answering fails the step instead of hanging it.

Invariants:
- Every rank calls the same collectives in the same order (the ranks run the same
  modules on the same step inputs); a collective that fails marks the group broken, and
  every later one raises at once with the first failure's reason.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage] - public, not in __all__

# How long a collective may wait for the other ranks before the step fails, in seconds
# (SHARDLINE_TP_TIMEOUT_S overrides it). A step's collectives wait only on the other
# ranks' share of the same forward; the longest is the load check's first forward.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def collective_timeout() -> datetime.timedelta:
    """How long one collective may wait (DEFAULT_COLLECTIVE_TIMEOUT_S, or the environment's)."""
    return datetime.timedelta(seconds=float(os.environ.get("SHARDLINE_TP_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S)))


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering: the group cannot run steps."""


class ShardingError(ValueError):
    """A model, or one of its modules, that the ranks cannot split exactly."""


def backend_for(device_type: str) -> str:
    """The collective backend of a device: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device_type == "cuda" else "gloo"


def join_group(store: Store, rank: int, size: int, device_type: str) -> None:
    """Join this process to the group as ``rank`` of ``size`` through ``store``."""
    if dist.is_initialized():
        raise TensorParallelError(
            f"tensor_parallel_size={size}: this process already belongs to a torch.distributed group; "
            "an engine with tensor parallelism starts its own")
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device_type), store=store, rank=rank, world_size=size,
                            timeout=collective_timeout())


def leave_group() -> None:
    """Destroy this process's group (after its last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class RankGroup:
    """This process's rank among ``size`` and the collectives the parallel layers call.
    ``explain``: says which rank failed and why, for the error a failed collective
    raises (rank 0 reads its rank processes' state; the others name rank 0)."""

    def __init__(self, rank: int, size: int, explain: Callable[[], str]) -> None:
        self.rank = rank
        self.size = size
        self._explain = explain
        self.failure: str | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``tensor``, in place."""
        self._run(lambda: dist.all_reduce(tensor))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape on all ranks) joined along the last
        dimension, rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run(lambda: dist.all_gather(parts, tensor.contiguous()))
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank, in place."""
        self._run(lambda: dist.broadcast(tensor, src=0))
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (ranks agreeing on a cache size)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self._device())
        self._run(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN))
        return int(tensor.item())

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")

    def _run(self, collective: Callable[[], object]) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            collective()
        except RuntimeError as error:  # torch.distributed's errors (DistBackendError, timeouts)
            self.failure = f"tensor-parallel group of {self.size} ranks stopped: {self._explain()} ({error})"
            raise TensorParallelError(self.failure) from error
