"""The LoRA slot cache of one model: adapters load once and stay in up to max_loras
device slots, least recently used out first.

Per step the runner calls ``prepare_step(lora_requests, num_tokens)`` with the
adapter (or None) and the number of scheduled tokens of each request, in packing
order; it activates the step's adapters and sets each packed token's slot. Only
adapters that the step does not use can be evicted, so a step may use up to
max_loras distinct adapters (the scheduler keeps it so); it never needs pinning
across steps, since an adapter evicted between steps is loaded again when its
request next runs.

Invariants:
- ``_slot_ids[s]`` is the lora_int_id whose weights every wrapped layer holds in
  slot s, or None; ``_lru`` holds exactly the resident ids, least recent first.
- An id keeps the path it was first checked with for the manager's lifetime, so
  the id alone identifies an adapter (the prefix-cache salt relies on it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Sequence

import torch
from torch import nn

from .adapter import AdapterSpec, inspect_adapter, load_adapter_weights
from .layers import BatchedLoRALinear, LoRATokenGroups, wrap_adaptable_layers
from .request import LoRAError, LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Wraps ``model``'s linear layers for batched LoRA and manages its adapter slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.token_groups = LoRATokenGroups()
        self.layers: dict[str, BatchedLoRALinear] = wrap_adaptable_layers(
            model, max_loras, max_lora_rank, self.token_groups, self.device, dtype
        )
        # The whole layers' shapes, which adapters are trained for (a tensor-parallel rank's
        # layers keep their share of each adapter, engine/lora/layers.py).
        self._layer_shapes = {name: layer.adapted_features for name, layer in self.layers.items()}
        self._specs: dict[int, AdapterSpec] = {}
        self._slot_ids: list[int | None] = [None] * max_loras
        self._lru: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot
        self.num_loads = 0

    @property
    def resident_ids(self) -> list[int]:
        """Adapter ids now in slots, least recently used first."""
        return list(self._lru)

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._lru.get(lora_int_id)

    def check(self, lora_request: LoRARequest) -> AdapterSpec:
        """Validate an adapter without loading its weights (cached per id). Raises
        LoRAError for a bad directory, a rank above max_lora_rank, modules the
        model lacks, an unsupported option, or an id already used for another path."""
        spec = self._specs.get(lora_request.lora_int_id)
        if spec is not None:
            if spec.request.lora_path != lora_request.lora_path:
                raise LoRAError(
                    f"lora_int_id {lora_request.lora_int_id} already names adapter {spec.request.lora_name!r} at "
                    f"{spec.request.lora_path!r}; {lora_request.lora_name!r} at {lora_request.lora_path!r} "
                    "needs another id"
                )
            return spec
        spec = inspect_adapter(lora_request, self._layer_shapes, self.max_lora_rank)
        self._specs[lora_request.lora_int_id] = spec
        return spec

    def activate(self, lora_request: LoRARequest, in_use: Collection[int] = ()) -> int:
        """Return the slot holding ``lora_request``'s adapter, loading it first if
        needed, into a free slot or the least recently used one whose id is not in
        ``in_use``."""
        spec = self.check(lora_request)
        lora_id = lora_request.lora_int_id
        if lora_id in self._lru:
            self._lru.move_to_end(lora_id)
            return self._lru[lora_id]
        weights = load_adapter_weights(spec, self.device, self.dtype)
        self.num_loads += 1
        slot = self._free_slot(lora_id, in_use)
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.set_slot(slot, *weights.get(name, (None, None)))
        self._slot_ids[slot] = lora_id
        self._lru[lora_id] = slot
        logger.info("loaded LoRA adapter %r (id %d, max rank %d) into slot %d",
                    lora_request.lora_name, lora_id, spec.max_rank, slot)
        return slot

    def _free_slot(self, lora_id: int, in_use: Collection[int]) -> int:
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        victim = next((resident for resident in self._lru if resident not in in_use), None)
        if victim is None:
            raise LoRAError(
                f"cannot load LoRA adapter id {lora_id}: all max_loras={self.max_loras} slots hold adapters in "
                f"use ({', '.join(map(str, self._lru))}); raise max_loras or run fewer adapters per batch"
            )
        return self._evict(victim)

    def _evict(self, lora_id: int) -> int:
        slot = self._lru.pop(lora_id)
        self._slot_ids[slot] = None
        with torch.no_grad():
            for layer in self.layers.values():
                layer.set_slot(slot, None, None)
        return slot

    def remove(self, lora_int_id: int) -> bool:
        """Free the slot of an adapter; False if it was not resident."""
        if lora_int_id not in self._lru:
            return False
        self._evict(lora_int_id)
        return True

    def set_token_slots(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Set, for the next forward, the slot of each packed token: slots [T] int64,
        -1 for no adapter. Every slot named must hold an adapter."""
        slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
        if slots.dim() != 1:
            raise ValueError(f"token slots must be a 1-D tensor [num_tokens], got shape {list(slots.shape)}")
        used = torch.unique(slots).tolist()
        bad = [slot for slot in used if not (slot == -1 or (0 <= slot < self.max_loras and self._slot_ids[slot]))]
        if bad:
            raise ValueError(f"token slots {bad} hold no adapter; occupied slots: "
                             f"{[s for s, i in enumerate(self._slot_ids) if i is not None]}, -1 means none")
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in (s for s in used if s >= 0):
            mask = slots == slot
            rows = None if bool(mask.all()) else mask.nonzero().flatten().to(self.device)
            groups.append((slot, rows))
        self.token_groups.num_tokens = int(slots.numel())
        self.token_groups.groups = groups

    def clear_token_slots(self) -> None:
        """No token uses an adapter in the next forward."""
        self.token_groups.num_tokens = 0
        self.token_groups.groups = []

    def prepare_step(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """Activate the adapters of one step's requests and set their tokens' slots.

        ``lora_requests[i]`` and ``num_tokens[i]`` describe the i-th request's
        scheduled tokens, which the packed batch holds contiguously in this order.
        """
        if len(lora_requests) != len(num_tokens):
            raise ValueError(f"{len(lora_requests)} LoRA requests for {len(num_tokens)} token counts")
        in_use = {request.lora_int_id for request in lora_requests if request is not None}
        if len(in_use) > self.max_loras:
            raise LoRAError(f"one step uses {len(in_use)} distinct LoRA adapters ({sorted(in_use)}) but "
                            f"max_loras={self.max_loras}")
        slot_by_id: dict[int, int] = {}
        for request in lora_requests:
            if request is not None and request.lora_int_id not in slot_by_id:
                slot_by_id[request.lora_int_id] = self.activate(request, in_use)
        request_slots = [-1 if r is None else slot_by_id[r.lora_int_id] for r in lora_requests]
        self.set_token_slots(torch.repeat_interleave(torch.tensor(request_slots, dtype=torch.int64),
                                                     torch.tensor(list(num_tokens), dtype=torch.int64)))
