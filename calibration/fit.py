"""Fitting step-cost models to measured engine steps: least squares, every coefficient kept
non-negative, each with its standard error.

A measured step is what `specgate calibrate` saw a server do: a batch of decoding sequences at
some context, or a prompt being prefilled, and how long it took. The target model's forward pass
is fitted as `LinearStepModel` (`base + per_token x tokens + per_kv x kv_tokens`); a speculative
server's steps, less that forward pass over their k+1 verified tokens, give the draft's cost
(`DraftCost`). Pure: numbers in, models out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specgate.calibration.costs import Batch, DraftCost, LinearStepModel, prompt_pairs


@dataclass(frozen=True)
class Step:
    """One measured engine step."""

    kind: str
    """What was measured (`prefill`, `decode`): errors are reported per kind."""
    decode_seqs: int
    query_per_seq: int
    mean_context: float
    prefill_tokens: int
    ms: float

    @property
    def batch(self) -> Batch:
        return Batch(self.decode_seqs, self.query_per_seq, self.mean_context, self.prefill_tokens,
                     1 if self.prefill_tokens else 0)  # fmt: skip


@dataclass(frozen=True)
class Term:
    name: str
    value: float
    stderr: float
    """One standard error of the value (NaN when the fit had no degrees of freedom left)."""

    @property
    def relative_error(self) -> float:
        return self.stderr / self.value if self.value else math.nan


@dataclass(frozen=True)
class LeastSquares:
    coefficients: tuple[float, ...]
    stderrs: tuple[float, ...]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    a = [[*row, b] for row, b in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(x) for row in a for x in row[:n])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]) -> LeastSquares:
    """Weighted least squares with every coefficient >= 0 (a column whose coefficient comes out
    negative is dropped and the rest refitted: a cost is never negative)."""
    columns = list(range(len(rows[0])))
    while True:
        xtx = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights, strict=True)) for j in columns] for i in columns]
        xty = [sum(w * r[i] * y for r, y, w in zip(rows, ys, weights, strict=True)) for i in columns]
        solution = _solve(xtx, xty) if columns else []
        if solution is None:  # a column the measurements cannot tell apart from the others
            columns = columns[:-1]
            continue
        negative = [c for c, v in zip(columns, solution, strict=True) if v < 0]
        if not negative:
            break
        columns = [c for c in columns if c != negative[0]]
    full = [0.0] * len(rows[0])
    for c, v in zip(columns, solution, strict=True):
        full[c] = v
    residual = sum(w * (y - sum(a * b for a, b in zip(r, full, strict=True))) ** 2
                   for r, y, w in zip(rows, ys, weights, strict=True))  # fmt: skip
    dof = len(ys) - len(columns)
    sigma2 = residual / dof if dof > 0 else math.nan
    errors = [math.nan] * len(full)
    for k, c in enumerate(columns):  # the diagonal of sigma2 (X'WX)^-1, the matrix of the last fit
        inverse_column = _solve(xtx, [1.0 if i == k else 0.0 for i in range(len(columns))])
        if inverse_column is not None and not math.isnan(sigma2):
            errors[c] = math.sqrt(max(sigma2 * inverse_column[k], 0.0))
    return LeastSquares(tuple(full), tuple(errors))


def _relative_errors(steps: Sequence[Step], predict: Callable[[Step], float]) -> dict[str, float]:
    """RMS of (predicted - measured) / measured, per kind of measurement."""
    by_kind: dict[str, list[float]] = {}
    for s in steps:
        by_kind.setdefault(s.kind, []).append((predict(s) - s.ms) / s.ms)
    return {k: math.sqrt(sum(e * e for e in v) / len(v)) for k, v in by_kind.items()}


@dataclass(frozen=True)
class TargetFit:
    model: LinearStepModel
    terms: tuple[Term, ...]
    errors: dict[str, float]
    """RMS relative error of the fitted model against the measurements, per kind."""


def fit_target(steps: Sequence[Step]) -> TargetFit:
    """The target model's forward pass: `base + per_token x decoding sequences + per_prefill x
    prompt tokens + per_kv x kv_tokens + per_pair x prompt pairs` (ms), fitted in relative terms (a
    5 ms step off by 1 ms matters as much as a 500 ms one off by 100). A prompt token has a cost of
    its own when prompts were measured (on a CPU, attention makes it dearer as the prompt grows),
    else it costs as one; with prompts of three lengths or more, attention within the prompt (p²/2
    pairs of tokens) has a cost of its own too."""
    if len(steps) < 3:
        raise ValueError("fitting a step model takes at least three measured steps")
    prompts = any(s.prefill_tokens for s in steps)
    pairs = len({s.prefill_tokens for s in steps if s.prefill_tokens}) >= 3
    rows, ys = [], []
    for s in steps:
        b = s.batch
        kv = b.decode_seqs * b.mean_context + b.prefill_tokens
        decoded = b.decode_seqs * b.query_per_seq
        row = [1.0, decoded / 1e3, kv / 1e6]
        if prompts:
            row.append(b.prefill_tokens / 1e3)
        if pairs:
            row.append(prompt_pairs(b) / 1e6)
        rows.append(tuple(row))
        ys.append(s.ms)
    fit = least_squares(rows, ys, [1.0 / (y * y) for y in ys])
    (base, per_token_us, per_kv_ns), (e0, e1, e2) = fit.coefficients[:3], fit.stderrs[:3]
    terms = [Term("step fixed cost (ms)", base, e0), Term("per decoding sequence (us)", per_token_us, e1),
             Term("per KV token (ns)", per_kv_ns, e2)]  # fmt: skip
    per_prefill_us, per_pair_ns = None, 0.0
    if prompts:
        per_prefill_us = fit.coefficients[3]
        terms.append(Term("per prompt token (us)", per_prefill_us, fit.stderrs[3]))
    if pairs:
        per_pair_ns = fit.coefficients[4]
        terms.append(Term("per prompt token pair (ns)", per_pair_ns, fit.stderrs[4]))
    model = LinearStepModel(
        base, per_token_us, per_kv_ns, 0.0, per_prefill_token_us=per_prefill_us, per_prompt_pair_ns=per_pair_ns
    )
    return TargetFit(model, tuple(terms), _relative_errors(steps, lambda s: model.forward_ms(s.batch)))


@dataclass(frozen=True)
class DraftFit:
    cost: DraftCost
    target: LinearStepModel
    """The target's model with what a verified draft token costs, drafting included."""
    terms: tuple[Term, ...]
    errors: dict[str, float]
    """RMS relative error of the speculative steps (target plus draft) against the measurements."""


def fit_draft(steps: Sequence[Step], target: LinearStepModel, k: int) -> DraftFit:
    """What a speculative server's steps take beyond the target's forward pass over its
    sequences' own tokens: a fixed cost per step (the proposer's), a cost per draft token verified
    (the draft's passes and the verification together: both grow with the sequences times k, so
    they cannot be told apart and need not be), and the draft's cost per prompt."""
    decode = [s for s in steps if s.decode_seqs]
    prefill = [s for s in steps if not s.decode_seqs and s.prefill_tokens]
    cost = DraftCost()
    terms: list[Term] = []
    if decode:
        rows = [(1.0, s.decode_seqs * (s.query_per_seq - 1) / 1e3) for s in decode]
        ys = [s.ms - target.forward_ms(replace(s.batch, query_per_seq=1)) for s in decode]
        fit = least_squares(rows, ys, [1.0 / (s.ms * s.ms) for s in decode])
        (fixed, per_verified_us), (e0, e1) = fit.coefficients, fit.stderrs
        cost = DraftCost(step_fixed_ms=fixed)
        target = replace(target, per_verify_token_us=per_verified_us)
        terms += [Term("draft per step (ms)", fixed, e0), Term("per draft token verified (us)", per_verified_us, e1)]
    if prefill:
        rows = [(1.0, s.prefill_tokens / 1e3) for s in prefill]
        # The prompt's sequence drafts in its step too (vLLM drafts for it as it joins the batch).
        ys = [s.ms - target.forward_ms(s.batch) - cost.step_ms(k, 1, 0.0) for s in prefill]
        fit = least_squares(rows, ys, [1.0 / (s.ms * s.ms) for s in prefill])
        (fixed, per_token_us), (e0, e1) = fit.coefficients, fit.stderrs
        cost = DraftCost(cost.step_fixed_ms, cost.pass_ms, cost.pass_per_seq_us, prefill_fixed_ms=fixed,
                         prefill_per_token_us=per_token_us)  # fmt: skip
        terms += [Term("draft prefill fixed (ms)", fixed, e0), Term("draft prefill per token (us)", per_token_us, e1)]

    def predict(s: Step) -> float:  # as the latency model prices a speculative step
        drafting = s.decode_seqs + (1 if s.prefill_tokens else 0)
        draft = cost.step_ms(k, drafting, drafting * s.mean_context) + cost.prefill_ms(s.prefill_tokens)
        return target.forward_ms(s.batch) + draft

    return DraftFit(cost, target, tuple(terms), _relative_errors([*decode, *prefill], predict))


def acceptance_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """Leviathan's per-token acceptance a such that (1 - a^(k+1)) / (1 - a) = tokens_per_step."""
    target = min(max(tokens_per_step, 1.0), k + 1 - 1e-9)
    low, high = 0.0, 1.0 - 1e-12
    for _ in range(100):
        mid = (low + high) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2
