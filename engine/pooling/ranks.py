"""An embedding model over tensor-parallel ranks.

Rank 0 is the PoolingEngine's own process: it schedules, pools and answers. It starts
ranks 1..N-1 (engine/parallel/ranks.py's RankDriver); each loads the same base model
and splits it with the generation models' sharding step (query and key-value heads,
MLP intermediate size, experts, the vocabulary-parallel input embedding). Per batch,
rank 0 sends every rank the packed token ids, positions and sequence lengths in one
message (``PackedBatch``), then runs the same forward beside them.

Invariant: the last hidden state is whole and equal on every rank (each row-split
projection's output is summed over ranks before the residual add), so rank 0 pools
it as one rank would; the other ranks' copies are dropped.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from ..config import EngineConfig
from ..model.kv_cache_spec import KVCacheSpec
from ..model.loader import LoadedModel, load_hf_config, load_model
from ..parallel.group import RankGroup
from ..parallel.placement import place_on_device
from ..parallel.ranks import RankDriver
from ..parallel.sharding import shard_model
from ..parallel.verdict import tensor_parallel_verdict
from .packed_attention import PackedAttentionContext
from .packed_attention import register as register_packed_attention


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One pooling forward's inputs: the requests' tokens concatenated, each token's
    position, and each request's length."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    seq_lens: tuple[int, ...]


def load_base_model(config: EngineConfig) -> LoadedModel:
    """The model without its head (transformers' AutoModel), attention packed."""
    return load_model(config, "embed", register_packed_attention())


def packed_forward(model: torch.nn.Module, batch: PackedBatch, device: torch.device,
                   token_type_ids: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``batch`` as one packed sequence; return (last hidden states [T, H],
    cu_seqlens [B + 1]). ``token_type_ids``: the model's forward takes them (all zero)."""
    ctx = PackedAttentionContext.from_seq_lens(list(batch.seq_lens), device)
    input_ids = torch.tensor([batch.token_ids], dtype=torch.int64, device=device)
    model_inputs: dict[str, torch.Tensor | PackedAttentionContext] = dict(
        input_ids=input_ids,
        position_ids=torch.tensor([batch.positions], dtype=torch.int64, device=device),
        shardline_packed_ctx=ctx,
    )
    if token_type_ids:
        model_inputs["token_type_ids"] = torch.zeros_like(input_ids)
    outputs = model(**model_inputs, use_cache=False)
    return outputs.last_hidden_state[0], ctx.cu_seqlens


def takes_token_type_ids(model: torch.nn.Module) -> bool:
    return "token_type_ids" in inspect.signature(model.forward).parameters


def shard_base_model(loaded: LoadedModel, group: RankGroup) -> None:
    """Split the loaded base model (on the CPU) into this rank's shard, on its device."""
    num_attention_layers = sum(1 for layer in KVCacheSpec.from_hf_config(loaded.hf_config, loaded.dtype).layers
                               if layer.num_kv_heads)
    shard_model(loaded.model, group, num_attention_layers)
    place_on_device(loaded.model, loaded.device)


class PoolingFollower:
    """A rank other than 0: its shard of the base model, run on each batch rank 0 sends."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.token_type_ids = takes_token_type_ids(loaded.model)

    @torch.inference_mode()
    def pool_forward(self, batch: PackedBatch) -> None:
        packed_forward(self.model, batch, self.device, self.token_type_ids)


def build_pooling_follower(config: EngineConfig, ranks: RankGroup) -> PoolingFollower:
    """A follower rank's side (its process's main builds it)."""
    loaded = load_base_model(config)
    shard_base_model(loaded, ranks)
    return PoolingFollower(loaded)


def start_pooling_ranks(config: EngineConfig) -> tuple[RankDriver, LoadedModel]:
    """Rank 0's side: refuse what the ranks cannot split (before any starts), start the
    other ranks, load and split rank 0's shard beside theirs. The ranks are stopped if
    any fails."""
    tensor_parallel_verdict(load_hf_config(config), config.tensor_parallel_size, quantization=config.quantization,
                            task="embed", trust_remote_code=config.trust_remote_code)
    driver = RankDriver(config, build_pooling_follower)
    try:
        loaded = load_base_model(config)
        shard_base_model(loaded, driver.group)
        driver.wait_ready()
    except BaseException:
        driver.close()
        raise
    return driver, loaded
