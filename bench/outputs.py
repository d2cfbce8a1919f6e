"""What the offline benchmarks share: their runs spread over every core, and their figures written."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def in_parallel(run: Callable[[J], R], jobs: Sequence[J], workers: int, chunksize: int = 1) -> list[R]:
    """`run` of every job, in their order, on `workers` processes (handed `chunksize` jobs at a
    time), with a progress bar on stderr."""
    results = []
    with ProcessPoolExecutor(max_workers=max(workers, 1)) as pool:
        for done, result in enumerate(pool.map(run, jobs, chunksize=chunksize), start=1):
            results.append(result)
            sys.stderr.write(f"\r[{'#' * (30 * done // len(jobs)):<30}] {done}/{len(jobs)} runs")
    print(file=sys.stderr)
    return results


def write(out: Path, name: str, data: object, text: str, report_name: str | None = None) -> None:
    """`name`.json and the report (`report_name`.md, else `name`.md) in `out`; the report printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{report_name or name}.md").write_text(text)
    print(text)
