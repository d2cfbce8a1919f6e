"""The house: one import name, rooms that import only downward, and a decision without I/O.

docs/architecture.md draws the rooms; this test holds the code to the drawing. Every import is
read from the source (function-level ones too), so an edge cannot hide from it.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specgate"

ALLOWED: dict[str, set[str]] = {
    "validation": set(),
    "calibration": {"validation"},
    "protocol": set(),
    "workers": {"calibration", "protocol", "validation"},
    "sim": {"calibration", "protocol", "validation"},
    "policies": {"workers", "calibration", "validation"},
    "gateway": {"policies", "workers", "calibration", "protocol", "validation"},
    "testing": {"workers", "calibration", "protocol", "validation"},
    "bench": {"testing", "gateway", "policies", "workers", "sim", "calibration", "protocol", "validation"},
    "cli": {"bench", "testing", "gateway", "policies", "workers", "sim", "calibration", "protocol", "validation"},
    "__main__": {"cli"},
    "__init__": set(),
}
"""Which rooms each room may import: command line -> bench -> gateway -> policies -> workers ->
calibration, and bench -> sim -> calibration; protocol and validation import nothing of specgate,
calibration only the validation vocabulary (to read profile files)."""

IMPURE = {"asyncio", "aiohttp", "redis", "socket", "subprocess", "os", "time", "random", "threading", "pathlib"}
"""What a module of the decision (policies/) must not import: I/O, clocks, randomness."""


def room_of(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def modules() -> list[Path]:
    # The rooms are linked into specgate/; walk them through the links, as Python imports them.
    found = []
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return sorted(found)


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_every_room_is_in_the_drawing() -> None:
    assert {room_of(p) for p in modules()} <= set(ALLOWED)
    for room in ("gateway", "policies", "workers", "calibration", "sim", "bench", "cli", "protocol"):
        assert (ROOT / room).is_dir()  # the top-level folders stay where the project keeps them
        assert (PACKAGE / room).resolve() == (ROOT / room).resolve()


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    room = room_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        assert top not in ("gateway", "policies", "workers", "bench", "sim", "calibration", "cli"), (
            f"{name}: import it as specgate.{name}"
        )
        if top != "specgate" or name == "specgate":
            continue
        target = name.split(".")[1]
        assert target == room or target in ALLOWED[room], f"{room} must not import {name}"


@pytest.mark.parametrize("path", [p for p in modules() if room_of(p) == "policies"], ids=lambda p: p.name)
def test_the_decision_does_no_io(path: Path) -> None:
    assert not {name.split(".")[0] for name in imports(path)} & IMPURE


def test_children_start_from_one_module_path() -> None:
    ours = re.compile(r"""["']-m["'],\s*["'](specgate|gateway|policies|workers|bench|sim|cli)\b""")
    spelled = [p for p in modules() if ours.search(p.read_text())]
    assert spelled == [], "start children with launch.specgate_argv or launch.module_argv"


@pytest.mark.slow
def test_a_wheel_installs_one_import_name(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes its build folder into the tree it builds.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "docs", "logs")
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip, "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("specgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specgate"}
    for module in ("specgate/gateway/relay.py", "specgate/sim/engine.py", "specgate/calibration/profiles.py",
                   "specgate/cli/__init__.py", "specgate/__main__.py", "specgate/py.typed"):  # fmt: skip
        assert module in names
