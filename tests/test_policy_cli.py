"""`specgate policy` against a real redis-server: validate, set, get, history, diff, rollback and exit codes."""

import dataclasses
import datetime
import json
from pathlib import Path

import pytest

from specgate.calibration import profile_file
from specgate.calibration.profiles import H100_LLAMA31_8B
from specgate.cli import main
from specgate.testing import RedisServer


def write(tmp_path: Path, name: str, doc: object) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, "good.json", {"schema_version": 1, "policy": "threshold", "params": {"max_load": 4}})
    assert run(capsys, "policy", "validate", good)[0] == 0
    bad = write(tmp_path, "bad.json", {"schema_version": 1, "exploration": 3})
    code, _, err = run(capsys, "policy", "validate", bad)
    assert code == 2
    assert "exploration" in err
    assert run(capsys, "policy", "validate", str(tmp_path / "missing.json"))[0] == 2


def test_validate_a_document_naming_a_profile_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = dataclasses.replace(H100_LLAMA31_8B, name="my-fleet")
    profile = tmp_path / "my-fleet.json"
    profile.write_bytes(profile_file.dumps(mine, "a test", datetime.date(2026, 12, 1)))
    doc = write(tmp_path, "doc.json", {"schema_version": 1, "profile": "my-fleet"})
    code, _, err = run(capsys, "policy", "validate", doc)
    assert code == 2
    assert "unknown profile 'my-fleet'" in err
    code, out, _ = run(capsys, "policy", "validate", doc, "--profile-file", str(profile))
    assert (code, out.strip()) == (0, "specgate policy: valid (adaptive, profile my-fleet)")
    code, _, err = run(capsys, "policy", "validate", doc, "--profile-file", str(tmp_path / "missing.json"))
    assert code == 2
    assert "--profile-file" in err


def test_set_get_history_diff_rollback(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = ("--redis", redis_server.url)
    first = write(tmp_path, "a.json", {"schema_version": 1, "policy": "least-loaded"})
    second = write(
        tmp_path, "b.json", {"schema_version": 1, "policy": "least-loaded", "pools": {"plain": {"drain": True}}}
    )
    assert run(capsys, "policy", "get", *r)[0] == 1  # nothing stored yet
    assert run(capsys, "policy", "set", first, *r, "--why", "start")[0] == 0
    assert run(capsys, "policy", "set", second, *r, "--why", "drain plain")[0] == 0

    code, out, _ = run(capsys, "policy", "get", *r)
    current = json.loads(out)
    assert (code, current["version"], current["why"]) == (0, 2, "drain plain")
    assert current["document"]["pools"]["plain"]["drain"] is True

    code, out, _ = run(capsys, "policy", "history", *r)
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["2", "1"]
    assert lines[0].endswith("drain plain")

    code, out, _ = run(capsys, "policy", "diff", "1", *r)
    assert code == 0
    assert '-      "drain": false,' in out
    assert '+      "drain": true,' in out

    code, out, _ = run(capsys, "policy", "rollback", "1", *r)
    assert (code, "version 3" in out) == (0, True)
    code, out, _ = run(capsys, "policy", "get", *r)
    assert json.loads(out)["document"]["pools"]["plain"]["drain"] is False

    # A stale expectation is a conflict (exit 3); an unknown version, bad input (exit 2).
    code, _, err = run(capsys, "policy", "set", first, *r, "--expect-version", "1")
    assert code == 3
    assert "version 3" in err
    assert run(capsys, "policy", "rollback", "77", *r)[0] == 2
    assert run(capsys, "policy", "diff", "77", *r)[0] == 2
    # Another prefix is another deployment.
    assert run(capsys, "policy", "get", *r, "--prefix", "other")[0] == 1


def test_unreachable_store_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = write(tmp_path, "a.json", {"schema_version": 1})
    code, _, err = run(capsys, "policy", "set", doc, "--redis", "redis://127.0.0.1:9/0")
    assert code == 1
    assert "cannot use the store" in err
