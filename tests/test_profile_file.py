"""Profiles in files: every built-in profile survives the file format, a bad file is refused naming
its field, and a file's profile is used wherever a built-in one is (the simulated replica, the
offline simulator, the gateway's config and policy document)."""

import datetime
import json
from dataclasses import replace
from pathlib import Path

import pytest

from specgate.bench.offline import Fleetspec, Scenario, simulate
from specgate.bench.traces import TraceRequest
from specgate.calibration import profile_file
from specgate.calibration.costs import LinearStepModel
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import H100_LLAMA31_8B, PROFILES
from specgate.cli import main
from specgate.gateway.config import ConfigError, parse_settings
from specgate.policies.document import DocumentError, parse
from specgate.testing import start_sim, stop_process
from specgate.validation import Invalid

CREATED = datetime.date(2026, 12, 1)


def _twice_as_slow() -> profile_file.ProfileFile:
    steps = H100_LLAMA31_8B.steps
    assert isinstance(steps, LinearStepModel)
    slow = LinearStepModel(
        steps.base_ms * 2, steps.per_token_us * 2, steps.per_kv_token_ns * 2, steps.step_overhead_ms * 2
    )
    profile = replace(H100_LLAMA31_8B, name="my-slow-h100", title="the 8B fit, every cost doubled", steps=slow)
    return profile_file.ProfileFile(profile, "a test: H100_LLAMA31_8B with its step costs doubled", CREATED)


def _write(tmp_path: Path, f: profile_file.ProfileFile, name: str = "slow.json") -> Path:
    path = tmp_path / name
    path.write_bytes(profile_file.dumps(f.profile, f.source, f.created))
    return path


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_built_in_profile_survives_the_file_format(name: str) -> None:
    raw = profile_file.dumps(PROFILES[name], "copied", CREATED)
    back = profile_file.loads(raw)
    assert back.profile == PROFILES[name]
    assert (back.source, back.created) == ("copied", CREATED)


def _document(**changes: object) -> bytes:
    obj = json.loads(profile_file.dumps(H100_LLAMA31_8B, "copied", CREATED))
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = obj
        for part in parents:
            node = node[part]
        node[last] = value
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (b"{", "(profile file)", "not valid JSON"),
        (_document(specgate_profile=2), "specgate_profile", "invalid enum value 2"),
        (_document(profile__spec__acceptance_mean=1.5), "profile.spec", "acceptance_mean must lie in [0, 1)"),
        (_document(profile__steps__kind="cubic"), "profile.steps.kind", "invalid value 'cubic'"),
        (_document(profile__steps__base_ms=-1), "profile.steps.base_ms", ">= 0"),
        (_document(profile__name="no spaces please"), "profile.name", "expected str matching regex"),
        (_document(created="yesterday"), "created", "invalid RFC3339 encoded date"),
        (_document(profile__sneaky=1), "profile.sneaky", "unknown key; known: name, title"),
    ],
)
def test_a_bad_file_is_refused_naming_its_field(raw: bytes, field: str, message: str) -> None:
    with pytest.raises(Invalid) as exc:
        profile_file.loads(raw)
    assert exc.value.field == field
    assert message in exc.value.message


def test_files_that_cannot_be_read_or_clash_are_refused(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match="cannot read"):
        profile_file.load(tmp_path / "missing.json")
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (profile_file.MAX_FILE_BYTES + 1))
    with pytest.raises(Invalid, match="larger than"):
        profile_file.load(huge)
    copy = profile_file.ProfileFile(H100_LLAMA31_8B, "copied", CREATED)
    with pytest.raises(Invalid, match="already known"):
        profile_file.with_files([copy])
    slow = _twice_as_slow()
    assert profile_file.with_files([slow])["my-slow-h100"] is slow.profile
    with pytest.raises(Invalid, match="already known"):
        profile_file.with_files([slow, slow])


def test_a_policy_document_names_a_file_profile_only_where_it_is_loaded() -> None:
    slow = _twice_as_slow()
    doc = {"schema_version": 1, "policy": "adaptive", "profile": "my-slow-h100"}
    with pytest.raises(DocumentError, match="unknown profile 'my-slow-h100'"):
        parse(doc)
    known = profile_file.with_files([slow])
    plan = parse(doc, profiles=known).compile("1", known)
    assert plan.model.profile is slow.profile


def test_the_config_loads_profile_files_beside_it(tmp_path: Path) -> None:
    _write(tmp_path, _twice_as_slow())
    config = {
        "models": {"served": ["m"]},
        "pools": {"plain": {"urls": ["http://127.0.0.1:9"]}},
        "profiles": {"files": ["slow.json"]},
        "policy": {"profile": "my-slow-h100"},
    }
    settings = parse_settings(config, tmp_path)
    assert settings.policy.profile == "my-slow-h100"
    assert settings.profiles["my-slow-h100"].steps == _twice_as_slow().profile.steps
    assert set(PROFILES) < set(settings.profiles)
    with pytest.raises(ConfigError) as exc:
        parse_settings({**config, "profiles": {"files": ["missing.json"]}}, tmp_path)
    assert exc.value.field == "profiles.files[0]"
    with pytest.raises(ConfigError, match="unknown profile 'my-slow-h100'"):
        parse_settings({**config, "profiles": {"files": []}}, tmp_path)


def test_the_offline_simulator_runs_a_file_profile_at_its_own_speed() -> None:
    trace = [TraceRequest(i * 2.0, 500, 50) for i in range(20)]
    slow = _twice_as_slow().profile

    def ttft(profile: object) -> float:
        summary = simulate(trace, Scenario(profile, Fleetspec(0, 1), "least-loaded"))  # type: ignore[arg-type]
        return float(summary.summary()["ttft_p50_ms"])

    assert ttft(slow) == pytest.approx(2 * ttft(H100_LLAMA31_8B), rel=0.1)


def test_sim_lists_and_runs_a_file_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _twice_as_slow())
    assert main(["sim", "--profile-file", str(path), "--list-profiles"]) == 0
    out = capsys.readouterr().out
    assert "my-slow-h100: the 8B fit, every cost doubled" in out
    assert f"from a file ({path}): a test: H100_LLAMA31_8B with its step costs doubled; created 2026-12-01" in out
    assert main(["sim", "--profile-file", str(tmp_path / "missing.json")]) == 2
    assert "--profile-file" in capsys.readouterr().err

    sim = start_sim(tmp_path / "sim.log", "--port", "0", "--profile-file", str(path), "--mode", Pool.PLAIN.value)
    try:
        assert "(profile my-slow-h100," in (tmp_path / "sim.log").read_text()
    finally:
        stop_process(sim.proc)
