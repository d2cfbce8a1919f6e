"""Profiles in files: a profile measured on the user's own servers, or written by hand, loaded
beside the built-in ones and used wherever a built-in one is.

A profile file is JSON:

    {"specgate_profile": 1,
     "source": "what it was measured on, and how",
     "created": "2026-12-01",
     "profile": {"name": "my-l4-llama", "title": ..., "steps": {"kind": "linear", ...}, ...}}

`profile` holds the fields of `Profile`; its step model is tagged by `kind`, `table` (measured
operator tables, `TableStepModel`) or `linear` (a fitted `LinearStepModel`). Every field is
checked as it is read; an error names the field (`profile.spec.acceptance_mean: ...`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from specgate.calibration.costs import Curve, Linear, LinearStepModel, StepTable, TableStepModel
from specgate.calibration.profiles import PROFILES, Profile, SpecProfile
from specgate.validation import Invalid, NonEmpty, PositiveInt, ProfileName, convert

FORMAT: Literal[1] = 1
MAX_FILE_BYTES = 1 << 20


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="table", tag_field="kind"):
    decode: StepTable
    verify: StepTable
    verify_query: Annotated[int, Meta(ge=2)]
    prefill: Curve
    weight_read_ms: Annotated[float, Meta(ge=0)]
    overhead: Linear


class _Linear(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag="linear", tag_field="kind"
):
    base_ms: Annotated[float, Meta(ge=0)]
    per_token_us: Annotated[float, Meta(ge=0)]
    per_kv_token_ns: Annotated[float, Meta(ge=0)]
    step_overhead_ms: Annotated[float, Meta(ge=0)]
    per_prefill_token_us: Annotated[float, Meta(ge=0)] | None = None
    per_verify_token_us: Annotated[float, Meta(ge=0)] | None = None
    per_prompt_pair_ns: Annotated[float, Meta(ge=0)] = 0.0


class _Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: ProfileName
    title: NonEmpty
    model: NonEmpty
    hardware: NonEmpty
    steps: _Table | _Linear
    kv_capacity_tokens: PositiveInt
    spec: SpecProfile
    max_model_len: Annotated[int, Meta(ge=2)]
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class _File(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    specgate_profile: Literal[1]
    source: NonEmpty
    created: datetime.date
    profile: _Profile


@dataclass(frozen=True)
class ProfileFile:
    """A profile read from a file, with what the file says of its origin."""

    profile: Profile
    source: str
    created: datetime.date
    path: Path | None = None

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.profile.describe()}\n  from a file{where}: {self.source}; created {self.created.isoformat()}"


def _steps(steps: object) -> _Table | _Linear:
    if isinstance(steps, TableStepModel):
        return _Table(**{f.name: getattr(steps, f.name) for f in fields(steps)})
    if isinstance(steps, LinearStepModel):
        return _Linear(**asdict(steps))
    raise TypeError(f"a profile file cannot hold a step model of type {type(steps).__name__}")


def dumps(profile: Profile, source: str, created: datetime.date) -> bytes:
    """The file for `profile`: JSON with its keys in a fixed order, indented for people to read."""
    record = _File(
        FORMAT,
        source,
        created,
        _Profile(
            profile.name, profile.title, profile.model, profile.hardware, _steps(profile.steps),
            profile.kv_capacity_tokens, profile.spec, profile.max_model_len, profile.sources, profile.notes,
        ),
    )  # fmt: skip
    return msgspec.json.format(msgspec.json.encode(record, order="deterministic"), indent=2) + b"\n"


def loads(raw: bytes, path: Path | None = None) -> ProfileFile:
    """Read a profile file's bytes; `Invalid` naming the field that is wrong."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise Invalid("(profile file)", f"not valid JSON: {exc}") from None
    record = convert(obj, _File, root="(profile file)")
    p = record.profile
    steps = p.steps
    try:
        model: TableStepModel | LinearStepModel
        if isinstance(steps, _Table):
            model = TableStepModel(
                steps.decode, steps.verify, steps.verify_query, steps.prefill, steps.weight_read_ms, steps.overhead
            )
        else:
            model = LinearStepModel(
                steps.base_ms, steps.per_token_us, steps.per_kv_token_ns, steps.step_overhead_ms,
                steps.per_prefill_token_us, steps.per_verify_token_us, steps.per_prompt_pair_ns,
            )  # fmt: skip
        profile = Profile(
            p.name, p.title, p.model, p.hardware, model, p.kv_capacity_tokens, p.spec, p.max_model_len,
            p.sources, p.notes,
        )  # fmt: skip
    except ValueError as exc:
        raise Invalid("profile", str(exc)) from None
    return ProfileFile(profile, record.source, record.created, path)


def load(path: Path) -> ProfileFile:
    """Read a profile file; `Invalid` when it cannot be read or is not a profile."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise Invalid(str(path), f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise Invalid(str(path), f"larger than {MAX_FILE_BYTES} bytes: not a profile file")
    try:
        return loads(raw, path)
    except Invalid as exc:
        raise Invalid(f"{path}: {exc.field}", exc.message) from None


def load_all(paths: Sequence[Path]) -> tuple[list[ProfileFile], Mapping[str, Profile]]:
    """The files at `paths`, and every profile known with them (`with_files`)."""
    files = [load(path) for path in paths]
    return files, with_files(files)


def with_files(files: Sequence[ProfileFile], known: Mapping[str, Profile] = PROFILES) -> Mapping[str, Profile]:
    """The `known` profiles (the built-in ones) and those of `files`, by name; a name given twice
    is an error."""
    merged = dict(known)
    for f in files:
        if f.profile.name in merged:
            where = f" ({f.path})" if f.path else ""
            raise Invalid(f"{f.profile.name}{where}", "a profile of that name is already known")
        merged[f.profile.name] = f.profile
    return MappingProxyType(merged)
