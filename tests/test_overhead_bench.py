"""`specgate bench overhead`: every path answers, and the router's CPU is counted per request and chunk."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_overhead_bench_measures_every_path_without_a_failed_answer(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed: run scripts/setup --dev (the README's test command does)")
    done = subprocess.run(
        [sys.executable, "-m", "specgate", "bench", "overhead", "--seconds", "0.5", "--rounds", "1", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads((tmp_path / "overhead.json").read_text())
    assert {"direct", "bare relay", "specgate"} <= set(figures)
    for name, path in figures.items():
        assert path["failed_wrk"] == 0, name  # a router that fails fast is not fast
        assert path["errors_at_rate"] == 0, name
        assert path["rps_wrk"] > 0, name
        assert path["chunks_per_s"] > 0, name
        if name != "direct":
            assert path["router_cpu_us_per_request"] > 0, name
            assert path["router_cpu_us_per_chunk"] > 0, name
    assert "| router CPU per non-streamed request |" in (tmp_path / "overhead.md").read_text()
