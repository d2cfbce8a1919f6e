"""The TPOT slack of the requests on one replica: how much more delay each can take before it
misses its TPOT target.

A request with a TPOT target enters with its slack: the delay, in ms summed over its answer, that
its target leaves above its stall-free time per token. Every prompt placed on the replica after it
delays all the requests decoding there at once (its prefill rides in their steps), and spends that
much of each one's slack. One running total of what has been spent does that for all of them, so a
placement costs O(1) and an entry or exit O(log n), never a pass over the requests.

The policy reads it to count the SLOs a placement would break (`ReplicaState.missed_by`): the
requests it would push from meeting their TPOT target to missing it.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class SlackLedger:
    def __init__(self) -> None:
        self._marks: list[float] = []
        """Each request's slack plus what had been spent when it entered, sorted: its slack is
        left while the running total stays below its mark."""
        self._by_key: dict[object, float] = {}
        self.spent_ms = 0.0
        """Delay imposed on the replica's requests since the ledger was last empty."""

    def enter(self, key: object, slack_ms: float) -> None:
        if key in self._by_key:
            self.leave(key)
        mark = slack_ms + self.spent_ms
        self._by_key[key] = mark
        insort(self._marks, mark)

    def delay(self, ms: float) -> None:
        """Every request now on the replica is delayed by `ms`."""
        if ms > 0 and self._marks:
            self.spent_ms += ms

    def leave(self, key: object) -> None:
        mark = self._by_key.pop(key, None)
        if mark is None:
            return
        del self._marks[bisect_left(self._marks, mark)]
        if not self._marks:
            self.spent_ms = 0.0

    def marks(self) -> tuple[float, ...]:
        return tuple(self._marks)

    def __len__(self) -> int:
        return len(self._marks)


def missed_by(marks: tuple[float, ...], spent_ms: float, delay_ms: float) -> int:
    """Of the requests whose slack marks are `marks`, with `spent_ms` already spent, how many that
    still meet their TPOT target would miss it if delayed `delay_ms` more."""
    if delay_ms <= 0 or not marks:
        return 0
    return bisect_left(marks, spent_ms + delay_ms) - bisect_left(marks, spent_ms)
