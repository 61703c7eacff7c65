"""Duplicate requests computed once, their result copied to every row.

Datasets repeat rows outright. Two requests whose outputs cannot differ (the same
prompt text and tokens, images, adapter, priority and sampling parameters, the
structured-output constraint among them, with deterministic sampling: greedy, or a
fixed seed) need one computation: the first one's, the group's leader. Sampled
requests without a seed are never grouped: each must draw its own tokens.

Invariants:
- A group is one engine computation, named by its leader's request id, and the
  rows waiting for it: the leader's own row (until aborted) and its followers in
  the order they were added. A follower never reaches the scheduler.
- Aborting a row takes it out of its group; the computation is aborted only when
  no row of its group is left. Aborting one duplicate never aborts the others.
- A group ends when its computation's output is fanned out (or the computation is
  aborted or fails); a later identical request starts a new group, usually over
  the prefix cache's blocks.
- Every remaining row gets the output under its own request id and arrival time;
  a follower's copy shares nothing mutable with the others and names the
  computation in ``duplicate_of``.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace

from ..outputs import RequestOutput


@dataclass
class _Group:
    """One computation and the rows waiting for it (follower id -> arrival time)."""

    computation_id: str
    key: Hashable
    leader_wants_output: bool = True
    followers: dict[str, float] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.leader_wants_output) + len(self.followers)


class DuplicateRequests:
    """Groups identical deterministic requests of one engine (``enabled`` False: none)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._by_key: dict[Hashable, _Group] = {}
        self._by_computation: dict[str, _Group] = {}
        self._group_of_follower: dict[str, _Group] = {}
        self.num_collapsed = 0  # rows that joined a computation so far

    def key(self, deterministic: bool, *identity: Hashable) -> Hashable | None:
        """The grouping key of a request whose outputs are fixed by ``identity`` (its
        prompt, images, adapter, priority, params); None when it is not to be grouped."""
        return identity if self.enabled and deterministic else None

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` is a follower waiting on another computation."""
        return request_id in self._group_of_follower

    @property
    def num_extra_rows(self) -> int:
        """Rows waiting beyond one per computation (followers less aborted leaders)."""
        return sum(group.num_rows - 1 for group in self._by_computation.values())

    def join(self, request_id: str, key: Hashable | None, arrival_time: float) -> bool:
        """Add ``request_id`` as a follower of a running identical computation, if any."""
        group = self._by_key.get(key) if key is not None else None
        if group is None:
            return False
        group.followers[request_id] = arrival_time
        self._group_of_follower[request_id] = group
        self.num_collapsed += 1
        return True

    def lead(self, request_id: str, key: Hashable | None) -> None:
        """``request_id`` was queued in the engine: later identical requests join it."""
        if key is not None and key not in self._by_key:
            group = _Group(request_id, key)
            self._by_key[key] = group
            self._by_computation[request_id] = group

    def release(self, request_id: str) -> str | None:
        """A row is aborted: returns the engine computation to abort now, or None while
        other rows still wait for it. An id in no group is returned as it is."""
        group = self._group_of_follower.pop(request_id, None)
        if group is None:
            group = self._by_computation.get(request_id)
            if group is None:
                return request_id
            group.leader_wants_output = False
        else:
            del group.followers[request_id]
        if group.num_rows:
            return None
        self._end(group)
        return group.computation_id

    def drop(self, computation_id: str) -> None:
        """The computation failed or is aborted outright: its rows get no output here."""
        group = self._by_computation.get(computation_id)
        if group is not None:
            self._end(group)

    def clear(self) -> None:
        for group in list(self._by_computation.values()):
            self._end(group)

    def fan_out(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Each finished computation's output for every row still waiting for it."""
        rows: list[RequestOutput] = []
        for output in outputs:
            group = self._by_computation.get(output.request_id)
            if group is None:
                rows.append(output)
                continue
            self._end(group)
            if group.leader_wants_output:
                rows.append(output)
            rows += [_copy_for(output, follower_id, arrival_time)
                     for follower_id, arrival_time in group.followers.items()]
        return rows

    def _end(self, group: _Group) -> None:
        del self._by_computation[group.computation_id]
        if self._by_key.get(group.key) is group:
            del self._by_key[group.key]
        for follower_id in group.followers:
            self._group_of_follower.pop(follower_id, None)


def _copy_for(output: RequestOutput, request_id: str, arrival_time: float) -> RequestOutput:
    """The computation's output as row ``request_id``'s: its own id and arrival time,
    no list or object shared with another row's."""
    metrics = replace(output.metrics, arrival_time=arrival_time) if output.metrics is not None else None
    return replace(copy.deepcopy(output), request_id=request_id, metrics=metrics,
                   duplicate_of=output.request_id)
