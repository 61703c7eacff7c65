"""Per-request recurrent-state slots (hybrid and state-space models).

A recurrent layer's state (a convolution window, a delta-rule or SSM matrix) is one
fixed-size tensor per request, whatever the request's length. The model runner
keeps, per recurrent layer, one tensor with a leading slot dimension; this module
only decides which running request owns which slot. Pure Python, no torch.

Invariants:
- A slot is owned by at most one request, and a request owns at most one slot.
- Exactly the running requests of a model with recurrent layers own a slot: taken
  at admission or fork, given back at finish, abort and preemption.
- A slot's contents are meaningful only after its owner's first computed chunk: the
  runner tells each layer to start from zero state when a request computes from
  token 0, so a reused slot needs no clearing (and preemption restarts from zero).
"""

from __future__ import annotations


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
