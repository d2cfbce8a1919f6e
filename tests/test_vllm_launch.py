"""The [launch] section: vLLM command lines, the speculative config, and flags vLLM removed or never had."""

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from specgate.calibration.modes import Pool
from specgate.cli import main
from specgate.gateway.config import ConfigError, load_settings, parse_settings
from specgate.testing import cpu_dtype
from specgate.workers import launch
from specgate.workers.vllm_launch import (
    LaunchConfigError,
    Record,
    parse_launch,
    records,
    start,
    stop,
    stop_recorded,
    write_records,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
LAUNCH: dict[str, Any] = {
    "python": "/opt/vllm/bin/python",
    "model": "./models/smol",
    "served_model_name": "smol",
    "args": ["--dtype", "bfloat16", "--max-model-len", "2048"],
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    "speculative": [{"port": 8101, "speculative_config": NGRAM, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}],
    "plain": [{"port": 8102, "args": ["--enforce-eager"], "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
}


def with_(path: str, value: object) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(LAUNCH))
    node: Any = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return doc


def test_command_lines(tmp_path: Path) -> None:
    plan = parse_launch(LAUNCH, tmp_path)
    spec, plain = plan.servers
    assert (spec.pool, spec.name, plain.pool, plain.name) == (Pool.SPECULATIVE, "spec-0", Pool.PLAIN, "plain-0")
    model = str(tmp_path / "models" / "smol")  # relative to the config file
    assert spec.argv() == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", "8101", "--served-model-name", "smol",
        "--dtype", "bfloat16", "--max-model-len", "2048",
        "--speculative-config", json.dumps(NGRAM, separators=(",", ":")),
    ]  # fmt: skip
    assert "--speculative-config" not in plain.argv()
    assert plain.argv()[-1] == "--enforce-eager"
    assert spec.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert plan.gateway_config() == (
        '[models]\nserved = ["smol"]\n\n[pools.speculative]\nurls = ["http://127.0.0.1:8101"]\n\n'
        '[pools.plain]\nurls = ["http://127.0.0.1:8102"]\n'
    )


def test_a_hub_model_id_stays_as_given(tmp_path: Path) -> None:
    plan = parse_launch(with_("model", "meta-llama/Llama-3.1-8B-Instruct"), tmp_path)
    assert plan.servers[0].model == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize(
    ("flag", "replacement"),
    [
        ("--speculative-model", "--speculative-config"),
        ("--speculative_model=tiny", "--speculative-config"),
        ("--num-speculative-tokens", "num_speculative_tokens inside --speculative-config"),
        ("--speculative-disable-by-batch-size", "adaptive or threshold policy"),
        ("--speculative-logits-mode", "never a vLLM flag"),
        ("--draft-model-tp", "draft_tensor_parallel_size"),
        ("--speculative-config", "[[launch.speculative]]"),
    ],
)
def test_retired_flags_name_their_replacement(flag: str, replacement: str) -> None:
    with pytest.raises(LaunchConfigError) as exc:
        parse_launch(with_("speculative.0.args", [flag, "5"]))
    assert str(exc.value).startswith(f"launch.speculative[0].args: {flag.split('=')[0].replace('_', '-')}")
    assert replacement in str(exc.value)


SPEC = "speculative.0.speculative_config"
SPEC_KEY = "launch.speculative[0].speculative_config"


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        (with_(SPEC, None), SPEC_KEY),
        (with_(SPEC, {**NGRAM, "method": "guess"}), f"{SPEC_KEY}.method"),
        (with_(SPEC, {**NGRAM, "num_speculative_tokens": 0}), f"{SPEC_KEY}.num_speculative_tokens"),
        (with_(SPEC, {"method": "draft_model", "num_speculative_tokens": 3}), f"{SPEC_KEY}.model"),
        (with_(SPEC, {**NGRAM, "prompt_lookup_min": 5}), SPEC_KEY),
        (with_("plain.0.speculative_config", NGRAM), "launch.plain[0].speculative_config"),
        (with_("plain.0.port", 8101), "launch.plain[0].port"),
        (with_("plain.0.port", 70000), "launch.plain[0].port"),
        (with_("plain.0.colour", "red"), "launch.plain[0].colour"),
        (with_("env", {"A": 1}), "launch.env"),
        (with_("args", "--enforce-eager"), "launch.args"),
        (with_("speculative", []) | {"plain": []}, "launch"),
        (with_("wings", 2), "launch.wings"),
        (with_("plain.0.cpus", [-1]), "launch.plain[0].cpus"),
        (with_("plain.0.cpus", "0-3"), "launch.plain[0].cpus"),
    ],
)  # fmt: skip
def test_errors_name_the_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(LaunchConfigError) as exc:
        parse_launch(doc)
    assert str(exc.value).startswith(key)


def test_a_server_pinned_to_cpus_runs_there_with_every_process_it_starts(tmp_path: Path) -> None:
    """vLLM's API server starts its engine core and workers itself: they must keep to its CPUs."""
    cpu = max(os.sched_getaffinity(0))
    plan = parse_launch(with_("plain.0.cpus", [cpu]), tmp_path)
    assert (plan.servers[0].cpus, plan.servers[1].cpus) == ((), (cpu,))
    script = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); "
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    log = tmp_path / "child.log"
    proc = launch.spawn([sys.executable, "-c", script], log, cpus=plan.servers[1].cpus)
    assert proc.wait(timeout=30) == 0
    assert log.read_text().split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]
    unpinned = launch.spawn([sys.executable, "-c", script], log)
    assert unpinned.wait(timeout=30) == 0
    assert log.read_text().split("\n")[0] == str(sorted(os.sched_getaffinity(0)))


def test_a_server_pinned_to_cpus_it_may_not_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    plan = parse_launch(with_("plain.0.cpus", [missing]) | {"log_dir": str(tmp_path / "logs")}, tmp_path)
    with pytest.raises(launch.LaunchError, match=rf"plain-0: cpus \[{missing}\] are not all CPUs"):
        start(plan)
    assert not (tmp_path / "logs").exists()  # nothing started, not even the speculative server


def test_each_server_has_a_temporary_directory_of_its_own_removed_when_it_stops(tmp_path: Path) -> None:
    """vLLM leaves its sockets and rendezvous files in the temporary directory; they must not
    outlive the servers, whether stopped by whoever started them or by `pools down`."""
    python = tmp_path / "python"  # stands in for vLLM's interpreter: leaves a socket's file, then serves
    python.write_text('#!/bin/sh\ntouch "$TMPDIR/0b7a1d5e-socket"\nsleep 60 &\nwait\n')
    python.chmod(0o755)
    doc = with_("python", str(python)) | {"log_dir": str(tmp_path / "logs")}
    for detach in (False, True):
        running = start(parse_launch(doc, tmp_path), detach=detach)
        try:
            tmps = [server.tmp for server in running]
            assert all(t is not None and t.parent == Path(tempfile.gettempdir()) for t in tmps)
            assert len(set(tmps)) == len(running)
            deadline = time.monotonic() + 10
            while not all((t / "0b7a1d5e-socket").exists() for t in tmps if t) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all((t / "0b7a1d5e-socket").exists() for t in tmps if t)
            if detach:
                assert [r.tmp for r in records(tmp_path / "logs")] == [str(t) for t in tmps]
                assert sorted(asyncio.run(stop_recorded(tmp_path / "logs", grace_s=5))) == ["plain-0", "spec-0"]
            else:
                asyncio.run(stop(running, grace_s=5))
            assert not any(t.exists() for t in tmps if t), detach
        finally:
            asyncio.run(stop(running, grace_s=1))
    # A record names its directory; one that names any other is not the server's to remove.
    kept = tmp_path / "kept"
    kept.mkdir()
    gone = running[0].proc.pid  # stopped above
    write_records(tmp_path / "logs", [Record("plain-0", gone, "http://127.0.0.1:1", "log", Pool.PLAIN, str(kept))])
    assert asyncio.run(stop_recorded(tmp_path / "logs", grace_s=1)) == []
    assert kept.exists()


def test_the_gateway_routes_to_the_launched_servers_when_no_pools_are_given() -> None:
    settings = parse_settings({"launch": LAUNCH})
    assert settings.models == ("smol",)
    assert settings.pools == {Pool.SPECULATIVE: ("http://127.0.0.1:8101",), Pool.PLAIN: ("http://127.0.0.1:8102",)}
    with pytest.raises(ConfigError, match=r"launch\.speculative"):
        parse_settings({"launch": with_("speculative.0.args", ["--num-speculative-tokens", "3"])})


def test_pools_commands_refuse_bad_configs(tmp_path: Path) -> None:
    config = tmp_path / "specgate.toml"
    config.write_text(
        '[launch]\nmodel = "m"\n[[launch.speculative]]\nport = 8101\nargs = ["--speculative-model", "d"]\n'
    )
    assert main(["pools", "up", "--config", str(config)]) == 2
    config.write_text('[models]\nserved = ["m"]\n')
    assert main(["pools", "up", "--config", str(config)]) == 2  # nothing to start
    assert main(["pools", "down", "--config", str(tmp_path / "missing.toml")]) == 2
    missing = max(os.sched_getaffinity(0)) + 1
    config.write_text(f'[launch]\nmodel = "m"\nlog_dir = "logs"\n[[launch.plain]]\nport = 8102\ncpus = [{missing}]\n')
    assert main(["pools", "up", "--config", str(config)]) == 1  # refused before anything starts
    assert not (tmp_path / "logs").exists()


def test_pools_switch_refuses_what_it_cannot_switch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is drained or stopped: no store, a bad store URL, a server the
    config does not start, one no detached `pools up` recorded."""
    config = tmp_path / "specgate.toml"
    config.write_text('[launch]\nmodel = "m"\nlog_dir = "logs"\n[[launch.plain]]\nport = 8102\n')
    switch = ["pools", "switch", "plain-0", "--to", "speculative", "--config", str(config)]
    assert main(switch) == 2
    assert "policy store" in capsys.readouterr().err
    assert main([*switch, "--redis", "http://127.0.0.1:1"]) == 2
    assert "redis://" in capsys.readouterr().err
    nowhere = ["--redis", "redis://127.0.0.1:1/0"]  # never reached: refused before
    assert main(["pools", "switch", "plain-7", "--to", "plain", "--config", str(config), *nowhere]) == 1
    assert "no server 'plain-7'" in capsys.readouterr().err
    assert main([*switch, *nowhere]) == 1
    assert "detached `specgate pools up`" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "spec", "plain"), [("cpu.toml", 1, 1), ("gpu.toml", 4, 4)])
def test_the_deploy_configs_parse(name: str, spec: int, plain: int) -> None:
    settings = load_settings(Path(__file__).resolve().parents[1] / "deploy" / name)
    assert (len(settings.pools[Pool.SPECULATIVE]), len(settings.pools[Pool.PLAIN])) == (spec, plain)
    assert settings.auth.enabled  # a deployment serves known clients only


def test_the_cpu_servers_run_in_bfloat16_only_where_the_cpu_has_avx512() -> None:
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_dtype(avx2) == "float32"
    assert cpu_dtype(avx2.replace("avx2", "avx2 avx512f avx512bw")) == "bfloat16"
    assert cpu_dtype(avx2.replace("avx2", "avx2 avx512_vnni")) == "float32"  # a flag, not a prefix
    assert cpu_dtype("processor\t: 0\nFeatures\t: fp asimd bf16\n") == "bfloat16"  # not x86: as before
    assert cpu_dtype("") == "bfloat16"
