"""One gateway's request counts per replica, shared by its processes (`specgate serve --workers N`).

Each process of the gateway sends requests to the same replicas and must count the others' as it
counts its own: between two scrapes a replica's load is what the gateway sent there, and N
processes each blind to the others would pile onto the replica that looked idle at the last one.
So each process publishes, per replica, what it has in flight there, what of that is still
prefilling, its dispatch and first-token counts and its prompt rates, in a row of a small
memory-mapped file that every process of the gateway maps; a process reads the others' rows when
it takes its snapshot. No locks: each row has one writer, every field is one aligned 8-byte word,
and a read that straddles a write sees one request's change a little early or late.

Each process also publishes, per pool, the sums its step-cost fit rests on (`latency_fit.py`): a
fit adds the others' to its own, so every process learns the step costs from every answer, not
from its share of them. Likewise the correction factors that follow what the fitted steps still
miss: each process moves the latest it finds, so they follow all the processes' answers at the
pace one process alone would see them. (In the offline simulator, three gateways on shared counts
each moving its own factors met 3 points fewer SLOs than one gateway; moving one set, under one.)

Each process publishes, too, how many requests it holds in its admission queue that can still
meet their targets (`hold`): a process places a request whose target has passed only when no
other holds one that can (`held_elsewhere`), as one queue would place them, or the requests that
can still be saved wait behind others' that cannot.

A replica is found in another process's row by a hash of its URL: processes name replicas in the
order they find them, which need not agree. A row's first slot counts the changes of its replicas
(taken or freed slots), so a reader searches a row again only when it has changed.

Other gateways in front of the same fleet (other hosts) are counted the same way, a little later:
the gateway's first process publishes a `summary` of its processes' rows and fits every fraction
of a second, through the policy's Redis (`gateway/exchange.py`), and writes the other gateways'
summaries, summed, into one more row of the file (`take_all`), where every process reads them as it
reads a sibling's. A summary's times are those of its taking, moved to the reader's clock on the
way in.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import tempfile
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specgate.workers.rates import as_counts, per_s

SLOTS = 256
"""Slots of a row: the first holds the row's generation, the others one replica each."""
FIELDS = 16
# The fields of a slot, in 8-byte words: its key (a signed 64-bit hash of the URL, 0 when free),
# then floats.
_IN_FLIGHT, _PREFILLING, _PREFILL_TOKENS, _DISPATCHED, _SENT = range(1, 6)
_RATES = 6
"""Two decaying rates (window, burst) of `_RATE_WORDS` each: prompts and tokens counted, when they
were last added to, and how long their prompts had been coming then (`rates.py`)."""
_RATE_WORDS = 4
_REQUEST_SECONDS = _RATES + 2 * _RATE_WORDS
"""The requests in flight integrated over time until a moment, and that moment."""


FITS = 2
"""Step-cost fits a process publishes: one per pool."""
FIT_TERMS = 5
"""The terms of a step-cost fit (`latency_fit.py`): three scales, the overhead and the wait."""
FIT_FIELDS = 3 + FIT_TERMS * FIT_TERMS + FIT_TERMS + 3
# The words of a fit: the basis it is fitted against (a key, 0 for none), the answers fitted, then
# the decayed sums of x xᵀ (FIT_TERMS squared) and of x y (FIT_TERMS); then the correction
# factors' basis (a key), the TTFT and TPOT factors, and the gateway's count of factor updates
# when they were written.
_BASIS, _FITTED, _XX = range(3)
_XY = _XX + FIT_TERMS * FIT_TERMS
_FACTORS_BASIS = _XY + FIT_TERMS
_TTFT_FACTOR, _TPOT_FACTOR, _FACTORS_STAMP = range(_FACTORS_BASIS + 1, _FACTORS_BASIS + 4)


def key_of(text: str) -> int:
    """A replica's URL, or a profile's name, as one nonzero 64-bit word."""
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    return key or 1


_MAGIC = 0x5347_4334  # a summary's first word: "SGC4" (its rates' times seen, fits of five terms, requests held)
_HEADER = 4
"""A summary's words before its fits: the magic, when it was taken (Unix seconds), its replicas,
the requests its gateway holds that can still meet their targets."""
_GATEWAYS, _HELD = 1, 2
"""Words of a row's first slot after its generation: in the other gateways' row, how many it
sums; in every row, the requests held in admission queues (`held`) that can still meet their
targets (the process's, or the other gateways' summed)."""


def _size(rows: int) -> int:
    return rows * (SLOTS * FIELDS + FITS * FIT_FIELDS) * 8


@dataclass
class Others:
    """The other processes' counts on one replica, summed."""

    in_flight: float = 0.0
    prefilling: float = 0.0
    prefill_tokens: float = 0.0
    dispatched: float = 0.0
    sent: float = 0.0
    rates: tuple[tuple[float, float], ...] = ()
    """Per rate window, prompts and prompt tokens a second."""
    request_seconds: float = 0.0
    """Their requests in flight, integrated over time (`Replica.request_seconds`)."""


class SharedCounts:
    """The mapped file: a row of `SLOTS` slots per process and one for the other gateways' (their
    sum), then each row's fits. Made once by the supervisor (`create`); opened by each process
    here, which clears its row and its fits (the first process, which writes the other gateways'
    row, that too)."""

    def __init__(self, path: Path, processes: int, index: int, others: bool = False) -> None:
        self.path = path
        self.processes = processes
        self.others = others
        """Whether it keeps a row for the other gateways' counts, summed (`take_all`)."""
        self.rows = processes + others
        """A row per process, and with `others` one more."""
        self.index = index
        """This process's row."""
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), _size(self.rows))
        self.words = memoryview(self._map).cast("d")
        self.keys = memoryview(self._map).cast("q")
        for row in [index, *(range(processes, self.rows) if index == 0 else ())]:
            self._clear(row)  # a process restarted in its row starts afresh

    def _clear(self, row: int) -> None:
        start = row * SLOTS * FIELDS
        generation = self.keys[start]
        for word in range(start, start + SLOTS * FIELDS):
            self.keys[word] = 0
        self.keys[start] = generation + 1
        for word in range(self._fit_base(row, 0), self._fit_base(row, FITS)):
            self.keys[word] = 0

    @staticmethod
    def create(processes: int, directory: Path | None = None, others: bool = False) -> Path:
        """A zeroed file for `processes` rows and, with `others`, the other gateways', in shared
        memory where there is one; the caller removes it."""
        if directory is None:
            shm = Path("/dev/shm")
            directory = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        fd, name = tempfile.mkstemp(prefix="specgate-counts-", dir=directory)
        with os.fdopen(fd, "wb") as file:
            file.truncate(_size(processes + others))
        return Path(name)

    def slot(self, url: str) -> SharedSlot:
        """This process's slot for the replica at `url` (taken, zeroed, if it has none)."""
        key = key_of(url)
        row = self.index * SLOTS
        free = None
        for slot in range(row + 1, row + SLOTS):
            if self.keys[slot * FIELDS] == key:
                return SharedSlot(self, key, slot)
            if free is None and self.keys[slot * FIELDS] == 0:
                free = slot
        if free is None:
            raise RuntimeError(f"more than {SLOTS - 1} replicas to share counts of")
        base = free * FIELDS
        self._free(free)
        self.keys[base] = key  # last: a reader finds it only once it is zeroed
        self.changed()
        return SharedSlot(self, key, free)

    def _fit_base(self, row: int, fit: int) -> int:
        return self.rows * SLOTS * FIELDS + (row * FITS + fit) * FIT_FIELDS

    def fit(self, number: int) -> SharedFit:
        """This process's fit `number` (one per pool, numbered alike in every process)."""
        return SharedFit(
            self, [self._fit_base(r, number) for r in range(self.rows)], self._fit_base(self.index, number)
        )

    def generation(self, row: int) -> int:
        """How often the replicas of `row` (a process's, or another gateway's) have changed."""
        return int(self.keys[row * SLOTS * FIELDS])

    def changed(self) -> None:
        self.keys[self.index * SLOTS * FIELDS] += 1

    def find(self, row: int, key: int) -> int | None:
        start = row * SLOTS
        for slot in range(start + 1, start + SLOTS):
            if self.keys[slot * FIELDS] == key:
                return slot
        return None

    # --- between gateways ---------------------------------------------------------------------

    def summary(self, now: float, windows: tuple[float, ...], wall: float) -> bytes:
        """This gateway's counts for the other gateways (`take_all`), taken at `now` (monotonic) and
        `wall` (Unix seconds): per replica its processes' slots summed, their rates and
        request-seconds brought to `now`; per pool its processes' fit sums (of the basis most
        answers were fitted against) and the latest of their correction factors; the requests its
        processes hold that can still meet their targets. Other gateways' rows are left out: each
        gateway speaks for itself alone."""
        words, keys = self.words, self.keys
        slots: dict[int, list[float]] = {}
        for process in range(self.processes):
            for slot in range(process * SLOTS + 1, (process + 1) * SLOTS):
                base = slot * FIELDS
                key = keys[base]
                if key == 0:
                    continue
                _add_slot(slots.setdefault(key, [0.0] * FIELDS), words, base, windows, now)
        out = array("d", [0.0] * (_HEADER + FITS * FIT_FIELDS + len(slots) * FIELDS))
        out_keys = memoryview(out).cast("B").cast("q")
        out_keys[0], out[1], out_keys[2] = _MAGIC, wall, len(slots)
        out[3] = sum(words[process * SLOTS * FIELDS + _HELD] for process in range(self.processes))
        for fit in range(FITS):
            processes = [(words, self._fit_base(process, fit)) for process in range(self.processes)]
            _merge_fits(out, _HEADER + fit * FIT_FIELDS, processes)
        for i, (key, fields) in enumerate(slots.items()):
            base = _HEADER + FITS * FIT_FIELDS + i * FIELDS
            out[base : base + FIELDS] = array("d", fields)  # its times (rates', request-seconds') 0: now
            out_keys[base] = key
        return out.tobytes()

    def take_all(
        self, me: str, summaries: Mapping[str, bytes], now: float, wall: float, windows: tuple[float, ...],
        stale_s: float, most: int,
    ) -> int:  # fmt: skip
        """The other gateways' summaries (all but `me`'s), summed into the row kept for them, their
        times moved to this process's clock (`now`, `wall`: as in `summary`); how many were summed.
        A summary is left out when it is not one (of this layout, whole, its counts finite and none
        negative) or is older than `stale_s` (or as far ahead: a clock not to be trusted); at most
        `most` are summed, in the order of their names. One row, whatever their number: a reader's
        work does not grow with the gateways."""
        slots: dict[int, list[float]] = {}
        taken: list[list[tuple[memoryview[float], int]]] = [[] for _ in range(FITS)]
        counted, held = 0, 0.0
        for name in sorted(summaries):
            parsed = _parsed(summaries[name]) if name != me and counted < most else None
            if parsed is None:
                continue
            words, found = parsed
            age = wall - words[1]
            if not -stale_s <= age <= stale_s:
                continue
            counted, age, held = counted + 1, max(age, 0.0), held + words[3]
            for key, at in found.items():  # (a summary's times are 0, its taking: `age` is now on its clock)
                _add_slot(slots.setdefault(key, [0.0] * FIELDS), words, at, windows, age)
            for fit in range(FITS):
                taken[fit].append((words, _HEADER + fit * FIT_FIELDS))
        fits = [array("d", [0.0] * FIT_FIELDS) for _ in range(FITS)]
        for merged, gateways in zip(fits, taken, strict=True):
            _merge_fits(merged, 0, gateways)
        self._write_others(slots, fits, now, counted, held)
        return counted

    def _write_others(
        self, slots: dict[int, list[float]], fits: list[array[float]], now: float, counted: int, held: float
    ) -> None:
        row = self.processes
        for fit in range(FITS):
            base, taken = self._fit_base(row, fit), memoryview(fits[fit]).cast("B").cast("q")
            self.keys[base + _BASIS] = self.keys[base + _FACTORS_BASIS] = 0  # (a reader skips them while they change)
            self.words[base + _FITTED : base + _FACTORS_BASIS] = fits[fit][_FITTED:_FACTORS_BASIS]
            self.words[base + _TTFT_FACTOR], self.words[base + _TPOT_FACTOR] = fits[fit][_TTFT_FACTOR:_FACTORS_STAMP]
            self.keys[base + _FACTORS_STAMP] = taken[_FACTORS_STAMP]
            self.keys[base + _BASIS], self.keys[base + _FACTORS_BASIS] = taken[_BASIS], taken[_FACTORS_BASIS]
        start, changed = row * SLOTS, False
        for slot in range(start + 1, start + SLOTS):
            if self.keys[slot * FIELDS] not in (0, *slots):
                self._free(slot)
                changed = True
        for key, fields in slots.items():
            found = self.find(row, key)
            if found is None:
                found = self.find(row, 0)
                if found is None:
                    continue  # (more replicas than a row holds: counted by its share)
                changed = True
            base = found * FIELDS
            self.words[base + 1 : base + FIELDS] = array("d", fields[1:])
            for i in range(2):
                self.words[base + _RATES + _RATE_WORDS * i + 2] = now
            self.words[base + _REQUEST_SECONDS + 1] = now
            self.keys[base] = key  # last: a reader finds it only once it is written
        self.words[start * FIELDS + _GATEWAYS] = counted
        self.words[start * FIELDS + _HELD] = held
        if changed:
            self.keys[start * FIELDS] += 1

    def _free(self, slot: int) -> None:
        base = slot * FIELDS
        self.keys[base] = 0
        for field in range(1, FIELDS):
            self.words[base + field] = 0.0

    def forget(self) -> None:
        """Count no other gateway: their counts are stale (Redis away)."""
        if self.others:
            self._write_others({}, [array("d", [0.0] * FIT_FIELDS) for _ in range(FITS)], 0.0, 0, 0.0)

    def gateways_counted(self) -> int:
        """The other gateways whose counts the row kept for them sums."""
        return int(self.words[self.processes * SLOTS * FIELDS + _GATEWAYS]) if self.others else 0

    def hold(self, live: int) -> None:
        """Publish how many requests this process holds in its admission queue that can still meet
        their targets: while any process or gateway in front of the fleet holds such a request, the
        others place none whose target has passed (`policies/admission.py`)."""
        self.words[self.index * SLOTS * FIELDS + _HELD] = live

    def held_elsewhere(self) -> float:
        """The requests the other processes, and the other gateways as last exchanged, hold that can
        still meet their targets."""
        return sum(self.words[row * SLOTS * FIELDS + _HELD] for row in range(self.rows) if row != self.index)

    def close(self) -> None:
        self.words.release()
        self.keys.release()
        self._map.close()


class SharedSlot:
    """One replica's slot in this process's row, and where the other processes keep theirs."""

    def __init__(self, counts: SharedCounts, key: int, slot: int) -> None:
        self.counts = counts
        self.key = key
        self.base = slot * FIELDS
        others = [row for row in range(counts.rows) if row != counts.index]
        self._found: dict[int, int | None] = dict.fromkeys(others)
        self._searched: dict[int, int] = dict.fromkeys(others, -1)
        """The generation of each other row when this replica was last searched for there."""

    def publish(
        self, in_flight: int, prefilling: int, prefill_tokens: int, dispatched: int, sent: int,
        rates: tuple[tuple[float, float, float, float], ...], request_seconds: tuple[float, float],
    ) -> None:  # fmt: skip
        words, base = self.counts.words, self.base
        words[base + _REQUEST_SECONDS], words[base + _REQUEST_SECONDS + 1] = request_seconds
        words[base + _IN_FLIGHT] = in_flight
        words[base + _PREFILLING] = prefilling
        words[base + _PREFILL_TOKENS] = prefill_tokens
        words[base + _DISPATCHED] = dispatched
        words[base + _SENT] = sent
        for i, rate in enumerate(rates):
            at_word = base + _RATES + _RATE_WORDS * i
            words[at_word : at_word + _RATE_WORDS] = array("d", rate)

    def others(self, now: float, windows: tuple[float, ...]) -> Others:
        """The other processes' counts on this replica now, their rates read at `now`
        (seconds on the monotonic clock, which all processes of one machine share)."""
        counts, words, keys = self.counts, self.counts.words, self.counts.keys
        out = Others()
        rates = [[0.0, 0.0] for _ in windows]
        for process in self._found:
            slot = self._found[process]
            if slot is None or keys[slot * FIELDS] != self.key:
                generation = counts.generation(process)
                if generation == self._searched[process]:
                    continue  # not there, and nothing changed there since
                self._searched[process] = generation
                slot = self._found[process] = counts.find(process, self.key)
                if slot is None:
                    continue
            base = slot * FIELDS
            out.in_flight += words[base + _IN_FLIGHT]
            out.prefilling += words[base + _PREFILLING]
            out.prefill_tokens += words[base + _PREFILL_TOKENS]
            out.dispatched += words[base + _DISPATCHED]
            out.sent += words[base + _SENT]
            since = max(now - words[base + _REQUEST_SECONDS + 1], 0.0)
            out.request_seconds += words[base + _REQUEST_SECONDS] + words[base + _IN_FLIGHT] * since
            for i, window in enumerate(windows):
                at_word = base + _RATES + _RATE_WORDS * i
                counted, counted_tokens, at, seen = words[at_word : at_word + _RATE_WORDS]
                prompts, tokens = per_s(counted, counted_tokens, at, seen, window, now)
                rates[i][0] += prompts
                rates[i][1] += tokens
        out.rates = tuple((prompts, tokens) for prompts, tokens in rates)
        return out

    def release(self) -> None:
        """The replica left this process's fleet: its slot is free again."""
        self.counts._free(self.base // FIELDS)
        self.counts.changed()


class SharedFit:
    """One pool's step-cost fit: the sums this process publishes, and the others' (`latency_fit.py`)."""

    def __init__(self, counts: SharedCounts, bases: list[int], own: int) -> None:
        self.counts = counts
        self.own = own
        self.others = [base for base in bases if base != own]

    def publish(self, basis: str, fitted: int, xx: list[list[float]], xy: list[float]) -> None:
        words, base = self.counts.words, self.own
        self.counts.keys[base + _BASIS] = 0  # (a reader skips it while it changes)
        words[base + _FITTED] = fitted
        for i in range(FIT_TERMS):
            words[base + _XY + i] = xy[i]
            for j in range(FIT_TERMS):
                words[base + _XX + FIT_TERMS * i + j] = xx[i][j]
        self.counts.keys[base + _BASIS] = key_of(basis)

    def publish_factors(self, basis: str, ttft: float, tpot: float, stamp: int) -> None:
        """This process's correction factors, after the update numbered `stamp` (`latest_factors`)."""
        words, base = self.counts.words, self.own
        self.counts.keys[base + _FACTORS_BASIS] = 0  # (a reader skips them while they change)
        words[base + _TTFT_FACTOR], words[base + _TPOT_FACTOR] = ttft, tpot
        self.counts.keys[base + _FACTORS_STAMP] = stamp
        self.counts.keys[base + _FACTORS_BASIS] = key_of(basis)

    def latest_factors(self, basis: str) -> tuple[float, float, int] | None:
        """The other processes' factors against `basis` as last updated (the highest stamp): the
        TTFT and TPOT factors and the stamp; None if none has any. Each process updates the
        latest it knows of, so the factors follow every process's answers, one after another."""
        words, keys, key = self.counts.words, self.counts.keys, key_of(basis)
        latest = None
        for base in self.others:
            stamp = int(keys[base + _FACTORS_STAMP])
            if keys[base + _FACTORS_BASIS] == key and (latest is None or stamp > latest[2]):
                latest = (words[base + _TTFT_FACTOR], words[base + _TPOT_FACTOR], stamp)
        return latest

    def summed(self, basis: str) -> tuple[int, list[list[float]], list[float]]:
        """The other processes' answers fitted and sums, of those fitted against `basis`."""
        words, keys, key = self.counts.words, self.counts.keys, key_of(basis)
        fitted, xx, xy = 0, [[0.0] * FIT_TERMS for _ in range(FIT_TERMS)], [0.0] * FIT_TERMS
        for base in self.others:
            if keys[base + _BASIS] != key:
                continue
            fitted += int(words[base + _FITTED])
            for i in range(FIT_TERMS):
                xy[i] += words[base + _XY + i]
                for j in range(FIT_TERMS):
                    xx[i][j] += words[base + _XX + FIT_TERMS * i + j]
        return fitted, xx, xy


def _add_slot(into: list[float], words: memoryview[float], base: int, windows: tuple[float, ...], now: float) -> None:
    """The slot at `base` of `words` added to `into`: its counts, and its rates and request-seconds
    brought to `now` (on the clock its times are on). `into`'s times are 0, `now`: its rates are
    counts that read as the rates summed, over the longest time seen of theirs (`rates.as_counts`)."""
    for field in range(_IN_FLIGHT, _RATES):
        into[field] += words[base + field]
    for i, window in enumerate(windows):
        at_word, into_word = base + _RATES + _RATE_WORDS * i, _RATES + _RATE_WORDS * i
        prompts, tokens, at, seen = words[at_word : at_word + _RATE_WORDS]
        if prompts == tokens == seen == 0.0:
            continue  # (no prompt yet, or only the first: nothing counted, no time seen)
        added = per_s(prompts, tokens, at, seen, window, now)
        summed = per_s(into[into_word], into[into_word + 1], 0.0, into[into_word + 3], window, 0.0)
        longest = max(into[into_word + 3], seen + max(now - at, 0.0))
        into[into_word : into_word + 2] = list(as_counts(added[0] + summed[0], added[1] + summed[1], longest, window))
        into[into_word + 3] = longest
    since = max(now - words[base + _REQUEST_SECONDS + 1], 0.0)
    into[_REQUEST_SECONDS] += words[base + _REQUEST_SECONDS] + words[base + _IN_FLIGHT] * since


def _parsed(summary: bytes) -> tuple[memoryview[float], dict[int, int]] | None:
    """A summary's words and where each replica's slot starts in them; None if it is not one (of
    this layout, whole, every number finite, no count negative and its factors positive)."""
    if len(summary) % 8 or len(summary) < (_HEADER + FITS * FIT_FIELDS) * 8:
        return None
    words, keys = memoryview(summary).cast("d"), memoryview(summary).cast("q")
    replicas = keys[2]
    if keys[0] != _MAGIC or not 0 <= replicas < SLOTS or len(words) != _HEADER + FITS * FIT_FIELDS + replicas * FIELDS:
        return None
    if words[3] < 0:
        return None
    floats = [words[1], words[3]]
    for fit in range(FITS):
        at = _HEADER + fit * FIT_FIELDS
        floats += words[at + _FITTED : at + _FACTORS_BASIS]
        factors = (words[at + _TTFT_FACTOR], words[at + _TPOT_FACTOR])
        if keys[at + _FACTORS_BASIS] != 0 and not all(f > 0 for f in factors):
            return None  # (a factor multiplies every prediction: none at zero or below)
        floats += factors
    slots: dict[int, int] = {}
    for i in range(replicas):
        at = _HEADER + FITS * FIT_FIELDS + i * FIELDS
        if keys[at] == 0 or keys[at] in slots or any(v < 0 for v in words[at + 1 : at + FIELDS]):
            return None
        floats += words[at + 1 : at + FIELDS]
        slots[keys[at]] = at
    return (words, slots) if all(math.isfinite(v) for v in floats) else None


def taken_at(summary: bytes) -> float | None:
    """When a summary was taken (Unix seconds), read from its header alone (whoever looks for old
    summaries to delete need not check the rest); None if it does not start as one."""
    if len(summary) % 8 or len(summary) < _HEADER * 8:
        return None
    words, keys = memoryview(summary).cast("d"), memoryview(summary).cast("q")
    return words[1] if keys[0] == _MAGIC and math.isfinite(words[1]) else None


def _merge_fits(out: array[float], at: int, fits: Sequence[tuple[memoryview[float], int]]) -> None:
    """One pool's fits (its processes', or other gateways') into one at `at` of `out`: the sums of
    those fitted against the basis most answers were fitted against (sums against different bases
    do not add; a tie goes to the first of them), and the correction factors of the latest (the
    highest stamp)."""
    out_keys = memoryview(out).cast("B").cast("q")
    sources = [(words, memoryview(words).cast("B").cast("q"), base) for words, base in fits]
    answers: dict[int, float] = {}
    for words, keys, base in sources:
        basis = keys[base + _BASIS]  # read once: a process that changes its fit zeroes it meanwhile
        if basis != 0:
            answers[basis] = answers.get(basis, 0.0) + words[base + _FITTED]
    if answers:
        chosen = max(answers, key=answers.__getitem__)
        for words, keys, base in sources:
            if keys[base + _BASIS] == chosen:
                for word in range(_FITTED, _FACTORS_BASIS):
                    out[at + word] += words[base + word]
        out_keys[at + _BASIS] = chosen
    factored = [(keys[base + _FACTORS_STAMP], words, keys, base) for words, keys, base in sources
                if keys[base + _FACTORS_BASIS] != 0]  # fmt: skip
    if factored:
        stamp, words, keys, base = max(factored, key=lambda source: source[0])
        out[at + _TTFT_FACTOR], out[at + _TPOT_FACTOR] = words[base + _TTFT_FACTOR], words[base + _TPOT_FACTOR]
        out_keys[at + _FACTORS_STAMP], out_keys[at + _FACTORS_BASIS] = stamp, keys[base + _FACTORS_BASIS]
