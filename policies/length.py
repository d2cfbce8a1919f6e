"""Expected output length, learned online from the lengths the gateway sees.

Requests are grouped by model, prompt-size band and an optional request class; each group keeps a
smoothed mean of the completion tokens its finished requests produced. A client's hint
(`x-expected-output-tokens`) wins; a group not seen yet falls back to its band's prior, and the
estimate never exceeds the request's `max_tokens`.

The priors are the Azure LLM inference traces' mean outputs by prompt size (conversation and code
together): long prompts (code completion, retrieval) tend to produce short answers.

Lengths are learned in the order their answers began, not the order they finish (`begin`,
`start`, `end`). Short answers finish first: when requests pour in (a burst, a gateway started
under load) the first dozens to finish are the shortest of them, and a mean taken as they finish
would fall to a fraction of the group's (a burst of conversation requests: 14 tokens learned, 217
the median sent), which prices every request of the group as a short life its prefill stalls
dominate. So a length finished waits until those of every request of its group whose answer began
before its own are known; one still running `MAX_WAIT_S` after it began holds back no more and is
learned when it ends. The order is that of first tokens, not of arrivals: under overload a request
waits in a queue for long before its answer begins, and one that arrived early and waits would hold
back the lengths of all those running meanwhile, so the band's prior would price requests for as
long as the queue is deep (code completions, a tenth of the prior's length, priced at the prior).
Even so, the few first known are those before the first long answer, still running, and a few
heavy-tailed lengths say little: a group's mean is pulled toward its band's prior by as much as the
mean's own error could explain the gap between them (`shrunk`). A mean of a few lengths near the
prior stays near it; one far from it (code completions, a tenth of the prior) is soon taken as it is.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from specgate.policies.means import GroupMeans

BAND_EDGES = (256, 1024, 4096)
"""Prompt-size bands: under 256 tokens, 256-1023, 1024-4095, 4096 and more."""
PRIORS = (200, 200, 150, 60)
"""Cold-start expected output tokens per band."""
SMOOTHING = 0.05
SPREAD = 1.0
"""Lengths' standard deviation over their mean, as a band's prior supposes them (the Azure traces'
bands: 0.5-0.85 in the conversation trace, 1.7-2.8 in the code trace)."""
MAX_GROUPS = 4096
"""Groups learned at most. `x-request-class` is the client's to choose: a client sending a new class
with every request must not grow the gateway's memory without end. Once this many are known, a
new group is not learned (its requests get their band's prior)."""
MAX_WAIT_S = 120.0
"""How long an answer still running holds back the lengths of its group's later ones: a few
thousand tokens' answer; past that, learning does not wait on it."""
MAX_PENDING = 4096
"""Answers of one group waiting for their length to be learned, at most; past that, an answer's
length is learned when it ends."""

Key = tuple[str, int, str]


def band(prompt_tokens: int) -> int:
    return bisect.bisect_right(BAND_EDGES, prompt_tokens)


def shrunk(mean: float, worth: float, prior: float) -> float:
    """A group's expected length from its mean, worth `worth` lengths, and its band's prior:
    pulled toward the prior in the ratio of the mean's variance (at the prior's `SPREAD`) to the
    squared gap between them (empirical Bayes, the gap standing for how far groups' means stray
    from their prior). The prior moves it by at most half the mean's standard error, so it never
    holds a group far from lengths it has learned, however wrong the prior."""
    variance = (SPREAD * prior) ** 2 / worth
    return mean + (prior - mean) * variance / (variance + (prior - mean) ** 2)


@dataclass(eq=False)
class Pending:
    """A request whose output length its group learns, from its arrival to its end."""

    key: Key
    started: float | None = None
    """When its answer began (its first token; None: not yet)."""
    length: int | None = None
    ended: bool = False
    queued: bool = False
    """In its group's queue: the lengths of those that began after it wait for its own."""


@dataclass
class LengthStats:
    """Mutable, owned by whoever routes (the gateway, the offline simulator); read by `expected`."""

    groups: GroupMeans[Key] = field(default_factory=lambda: GroupMeans(SMOOTHING, MAX_GROUPS))
    _queues: dict[Key, deque[Pending]] = field(default_factory=dict)
    """Per group, its answers begun and not yet learned, in the order they began."""

    def observe(self, model: str, prompt_tokens: int, output_tokens: int, request_class: str = "") -> None:
        """Learn one length at once (lengths of requests in flight: `begin` and `end`)."""
        self._learn((model, band(prompt_tokens), request_class), output_tokens)

    def begin(self, model: str, prompt_tokens: int, request_class: str = "") -> Pending | None:
        """A request arrived; None when its length is not learned."""
        key = (model, band(prompt_tokens), request_class)
        return Pending(key) if self.groups.learns(key) else None

    def start(self, pending: Pending | None, now: float) -> None:
        """The request's answer began `now` (on a clock `end` shares): its length is learned after
        those of its group's requests that began before it. Starting it again (its answer going on
        from another replica) changes nothing."""
        if pending is None or pending.started is not None or pending.ended:
            return
        pending.started = now
        queue = self._queues.setdefault(pending.key, deque())
        if len(queue) >= MAX_PENDING:
            return
        pending.queued = True
        queue.append(pending)
        self._release(pending.key, now)  # an answer long running at the head no longer holds back

    def end(self, pending: Pending | None, output_tokens: int | None, now: float) -> None:
        """The request ended `now`, having produced `output_tokens` (None: its length is not known,
        a request refused or failed). Ending it again changes nothing."""
        if pending is None or pending.ended:
            return
        pending.ended, pending.length = True, output_tokens
        if pending.queued:
            self._release(pending.key, now)
        elif output_tokens is not None:
            self._learn(pending.key, output_tokens)

    def _release(self, key: Key, now: float) -> None:
        """Learn the group's lengths known in the order their answers began, up to its first still running."""
        queue = self._queues[key]
        while queue:
            head = queue[0]
            if not head.ended and head.started is not None and now - head.started < MAX_WAIT_S:
                break
            queue.popleft()
            head.queued = False
            if head.length is not None:
                self._learn(key, head.length)
        if not queue:
            del self._queues[key]

    def _learn(self, key: Key, length: int) -> None:
        self.groups.observe(key, length)

    def expected(
        self,
        model: str,
        prompt_tokens: int,
        *,
        hint: int | None = None,
        max_tokens: int | None = None,
        request_class: str = "",
    ) -> int:
        if hint is not None:
            estimate = float(hint)
        else:
            key = (model, band(prompt_tokens), request_class)
            mean, prior = self.groups.means.get(key), float(PRIORS[key[1]])
            estimate = prior if mean is None else shrunk(mean, self.groups.worth(key), prior)
        if max_tokens is not None:
            estimate = min(estimate, max_tokens)
        return max(round(estimate), 1)
