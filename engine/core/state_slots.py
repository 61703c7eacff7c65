"""Per-request recurrent-state slots (hybrid and state-space models).

A recurrent layer's state (a convolution window, a delta-rule or SSM matrix) is one
fixed-size tensor per request, whatever the request's length. The model runner
keeps, per recurrent layer, one tensor with a leading slot dimension; this module
only decides which running request owns which slot (StateSlots) and which further
slots hold states saved at block boundaries of cached prefixes (StateSnapshots).
Pure Python, no torch.

Invariants:
- A slot is owned by at most one request, and a request owns at most one slot.
- Exactly the running requests of a model with recurrent layers own a slot: taken
  at admission or fork, given back at finish, abort and preemption.
- A slot's contents are meaningful only after its owner's first computed chunk: the
  runner tells each layer to start from zero state when a request computes from
  token 0, so a reused slot needs no clearing (and preemption restarts from zero).
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StateSlots:
    """Which request owns which of ``num_slots`` state slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        # Lowest slot first, so a small batch touches few slots.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it has none; None when none is free."""
        slot = self._owner.get(request_id)
        if slot is None and self._free:
            slot = self._free.pop()
            self._owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Give back the request's slot (a no-op when it has none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)


class StateSnapshots:
    """Recurrent states saved at block boundaries of cached prefixes, by block hash.

    A hybrid model's cached prefix is usable only where the recurrent state after it
    is known: the snapshot of block i holds every recurrent layer's state after the
    last token of block i. Snapshots live in ``num_snapshots`` extra state slots
    numbered from ``first_slot`` (after the requests' slots, in the same tensors).

    Invariants:
    - A hash has at most one snapshot slot and a slot holds at most one hash.
    - A snapshot is dropped with its block's hash (the KV cache evicts them together);
      when every slot is taken, claiming one drops the least recently used snapshot
      (its block stays cached, and prefix hits stop at an earlier snapshot).
    - ``num_wanting`` counts, per block hash, the unfinished requests whose prompt
      (less its last token) covers that block: a state is saved only where another
      request may continue from it.
    - A slot claimed in a step is not claimed again in that step, so no two requests
      save into one slot at once. (A slot restored from and claimed in one step is
      safe: each layer restores before it runs and saves after.)
    """

    def __init__(self, first_slot: int, num_snapshots: int) -> None:
        if num_snapshots <= 0:
            raise ValueError(f"num_snapshots must be positive, got {num_snapshots}")
        self.first_slot = first_slot
        self.num_snapshots = num_snapshots
        self._free: list[int] = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))
        # hash -> slot, least recently used first.
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._wanted: Counter[bytes] = Counter()
        self._wanted_by: dict[str, list[bytes]] = {}
        self._claimed_in_step: set[int] = set()

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def is_ready(self, block_hash: bytes) -> bool:
        """Whether the hash's snapshot can be restored: saved by a step scheduled before
        this one (steps run in order, so its save precedes this step's restores)."""
        slot = self._slot_of.get(block_hash)
        return slot is not None and slot not in self._claimed_in_step

    def use(self, block_hash: bytes) -> int:
        """The hash's snapshot slot, marked most recently used (it must have one)."""
        self._slot_of.move_to_end(block_hash)
        return self._slot_of[block_hash]

    def begin_step(self) -> None:
        self._claimed_in_step.clear()

    def claim(self, block_hash: bytes) -> int | None:
        """A slot for a new snapshot of ``block_hash`` (which has none), dropping the
        least recently used snapshot when none is free; None when that one was claimed
        in this step too."""
        assert block_hash not in self._slot_of, "the hash has a snapshot already"
        if self._free:
            slot = self._free.pop()
        else:
            oldest = next(iter(self._slot_of))
            if self._slot_of[oldest] in self._claimed_in_step:
                return None
            slot = self._slot_of.pop(oldest)
        self._slot_of[block_hash] = slot
        self._claimed_in_step.add(slot)
        return slot

    def drop(self, block_hash: bytes) -> None:
        """Forget the hash's snapshot (a no-op when it has none)."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def drop_slot(self, slot: int) -> None:
        """Forget the snapshot in ``slot`` (one claimed by a step that will not run it)."""
        for block_hash, held in self._slot_of.items():
            if held == slot:
                self.drop(block_hash)
                return

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache forgot its hashes)."""
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()

    def want(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Count ``block_hashes`` (the request's prompt blocks) as wanted by the request."""
        assert request_id not in self._wanted_by, request_id
        self._wanted_by[request_id] = block_hashes
        self._wanted.update(block_hashes)

    def unwant(self, request_id: str) -> None:
        """The request ended: its prompt blocks are wanted by one request fewer."""
        for block_hash in self._wanted_by.pop(request_id, ()):
            self._wanted[block_hash] -= 1
            if self._wanted[block_hash] <= 0:
                del self._wanted[block_hash]

    def num_wanting(self, block_hash: bytes) -> int:
        return self._wanted.get(block_hash, 0)
