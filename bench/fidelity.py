"""Fidelity of the simulated replica: its engine model against the figures it was calibrated on.

Everything runs in virtual time, so the figures are exact and repeatable (the section on the real
CPU servers is measured by `specgate bench cpu-fidelity` and only rendered here):

    specgate bench fidelity [--out docs/fidelity.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgate.calibration.costs import TableStepModel
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, WHITEPAPER, Profile
from specgate.sim.probes import decode_step, load_point, run_alone, speculative_run
from specgate.workers.acceptance import Acceptance, SpecCounters, acceptance


def acceptance_after_run(profile: Profile, alpha: float, requests: int = 40) -> Acceptance | None:
    """Acceptance read back from the spec counters after a speculative run at `alpha`."""
    c = speculative_run(profile, alpha, requests).counters
    return acceptance(SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens, tuple(c.accepted_per_pos)))


def _pct(got: float, want: float) -> str:
    return f"{(got - want) / want * 100:+.1f}%"


CPU_RESULTS = Path("docs/bench/cpu-fidelity/results.json")
"""What `specgate bench cpu-fidelity` measured on the real CPU servers, rendered here when present."""


def cpu_section(results: dict[str, Any]) -> str:
    """The simulated replica on a calibrated profile against the real CPU vLLM servers."""
    lines = [
        "## The CPU vLLM servers against their calibrated simulation",
        "",
        f"`{results['command']}`: the n-gram speculative and plain CPU servers of real_vllm.md, calibrated "
        f"(`specgate calibrate`, {results['sweep']} sweep), then `specgate sim` on that profile in real time. "
        f"As many requests at every load, fresh ones: {results['prompt_tokens']}-token prompts of random token ids, "
        f"{results['output_tokens']} tokens each (`ignore_eos`), {results['rounds']} times as many requests as the "
        "most in flight, that many in flight in a closed loop whose clients start spread over one request's "
        "time alone; medians as the client sees them. Off by: simulated over real, less one.",
        "",
        "| server | in flight | TTFT ms, real | sim | off by | TPOT ms, real | sim | off by "
        "| tokens/step, real / sim |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        server = f"{r['mode']} ({r['label']})" if r.get("label") else r["mode"]
        lines.append(
            f"| {server} | {r['clients']} | {r['ttft_real_ms']:.1f} | {r['ttft_sim_ms']:.1f} "
            f"| {r['ttft_deviation'] * 100:+.1f}% | {r['tpot_real_ms']:.1f} | {r['tpot_sim_ms']:.1f} "
            f"| {r['tpot_deviation'] * 100:+.1f}% | {r['tokens_per_step_real']:.2f} / {r['tokens_per_step_sim']:.2f} |"
        )
    lines.append("")
    for label in dict.fromkeys(r.get("label", "") for r in results["rows"]):
        rows = [r for r in results["rows"] if r.get("label", "") == label]
        worst = max(abs(r[k]) for r in rows for k in ("ttft_deviation", "tpot_deviation"))
        within = sum(abs(r[k]) <= 0.2 for r in rows for k in ("ttft_deviation", "tpot_deviation"))
        what = f"with {label}" if label else "on the calibrated profile"
        lines.append(
            f"- {what}: {within} of {2 * len(rows)} figures within ±20%, the largest off by {worst * 100:.1f}%"
        )
    calibrated = results["profile"]["profile"]["spec"]["acceptance_mean"]
    shown = [r["acceptance_real"] for r in results["rows"] if r.get("acceptance_real") and not r.get("label")]
    per_load = results["rounds"] * max(r["clients"] for r in results["rows"])
    lines += [
        "",
        f"What a speculative server accepts depends on what it is asked: the calibration's prompts gave a = "
        f"{calibrated:.2f} per draft token and step, these requests a = "
        + ", ".join(f"{a:.2f}" for a in shown)
        + f" (read from the real server's counters at each load, {per_load} fresh prompts each); the simulated "
        "replica runs the profile's mean, and again the mean the server showed here. Each load has prompts "
        "of its own: vLLM's prefix cache would serve prompts seen at another load with next to no prefill, "
        "which the simulated replica does not model. Requests sent in one burst would time a race instead "
        "of the servers (whether a request joins the others' prefill or waits for the next step depends on "
        "how fast the server's HTTP front hands it on); spread out, each meets the batch its load makes.",
        "",
        "The calibration it ran on:",
        "",
        "```",
    ]
    lines += [*str(results["calibration"]).splitlines(), "```", ""]
    return "\n".join(lines)


def report(cpu: dict[str, Any] | None = None) -> str:
    """The whole of docs/fidelity.md; the CPU section from `cpu`, else from `CPU_RESULTS` if measured."""
    if cpu is None and CPU_RESULTS.exists():
        cpu = json.loads(CPU_RESULTS.read_text())
    lines = ["# Simulated replica fidelity", "", "Generated by `specgate bench fidelity`; virtual time, exact.", ""]
    lines += [
        "## The whitepaper's batch-1 figures (512 prompt, 256 output tokens)",
        "",
        "| mode | TTFT ms (target) | TPOT ms (target) | TPOT ms, mean of 40 requests with drawn acceptance |",
        "|---|---|---|---|",
    ]
    for mode, ttft_want, tpot_want in ((Pool.PLAIN, 420.0, 38.0), (Pool.SPECULATIVE, 480.0, 18.0)):
        r = run_alone(WHITEPAPER, mode, 512, 256, spread=False)
        assert r.ttft is not None
        assert r.tpot is not None
        tpots = [run_alone(WHITEPAPER, mode, 512, 256, seed=s).tpot for s in range(40)]
        mean = statistics.mean(t for t in tpots if t is not None) * 1e3
        lines.append(
            f"| {mode.value} | {r.ttft * 1e3:.1f} ({ttft_want:.0f}, {_pct(r.ttft * 1e3, ttft_want)}) "
            f"| {r.tpot * 1e3:.1f} ({tpot_want:.0f}, {_pct(r.tpot * 1e3, tpot_want)}) "
            f"| {mean:.1f} ({_pct(mean, tpot_want)}) |"
        )
    steps = A100_CODELLAMA_34B.steps
    assert isinstance(steps, TableStepModel)
    table = steps.decode
    lines += [
        "",
        "## Measured profile: decode step vs. Vidur's A100 CodeLlama-34B TP2 table",
        "",
        "| context | batch | table ms | model GPU ms | deviation | whole step ms (+ CPU overhead) |",
        "|---|---|---|---|---|---|",
    ]
    for context, row in ((table.short_context, table.short_ms), (table.long_context, table.long_ms)):
        for batch in (1, 8, 32, 64):
            want = row[table.batch_sizes.index(batch)]
            gpu, whole = decode_step(A100_CODELLAMA_34B, batch, context)
            lines.append(f"| {context} | {batch} | {want:.1f} | {gpu:.1f} | {_pct(gpu, want)} | {whole:.1f} |")
    lines += [
        "",
        "## Measured profile under load (512 prompt, 256 output, all arriving at once)",
        "",
        "| concurrency | plain TPOT ms | speculative TPOT ms | speedup | preemptions plain / spec |",
        "|---|---|---|---|---|",
    ]
    for n in (1, 4, 16, 32, 64, 128, 256):
        p = load_point(A100_CODELLAMA_34B, n)
        lines.append(
            f"| {n} | {p.plain_tpot_ms:.1f} | {p.spec_tpot_ms:.1f} | {p.speedup:.2f}x "
            f"| {p.plain_preemptions} / {p.spec_preemptions} |"
        )
    lines += [
        "",
        "## KV pressure (measured profile with 20,000 KV slots, 1,024 prompt, 512 output)",
        "",
        "| concurrency | preemptions plain / spec |",
        "|---|---|",
    ]
    for n in (8, 16, 32, 64):
        p = load_point(A100_CODELLAMA_34B, n, prompt=1024, output=512, kv_capacity=20_000)
        lines.append(f"| {n} | {p.plain_preemptions} / {p.spec_preemptions} |")
    lines += ["", "## Acceptance read back from the spec counters", "", "| configured a | recovered a |", "|---|---|"]
    for alpha in (0.3, 0.6, 0.72, 0.85):
        est = acceptance_after_run(A100_CODELLAMA_34B, alpha)
        got = est.per_token_alpha if est else None
        lines.append(f"| {alpha:.2f} | {got:.3f} |" if got is not None else f"| {alpha:.2f} | - |")
    text = "\n".join(lines) + "\n"
    return text + "\n" + cpu_section(cpu) if cpu is not None else text


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench fidelity") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("docs/fidelity.md"))
    args = parser.parse_args(argv)
    text = report()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
