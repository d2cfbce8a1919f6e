"""`specgate policy`: read, change, audit and roll back the policy document in Redis.

    specgate policy validate FILE
    specgate policy get      --redis URL
    specgate policy set FILE --redis URL [--why TEXT] [--expect-version N]
    specgate policy history  --redis URL [--limit N]
    specgate policy rollback VERSION --redis URL [--why TEXT]
    specgate policy diff VERSION --redis URL

`set` reads the current version first and writes only if it is still current when the write
lands (`--expect-version` pins the version you reviewed instead); a conflict exits with 3.
Exit codes: 0 done, 1 the store is unreachable, 2 bad input, 3 version conflict.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import getpass
import socket
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson

from specgate.calibration import profile_file
from specgate.cli.arguments import Subcommands, common_options
from specgate.gateway.policy_sync import STORE_ERRORS
from specgate.gateway.store import PolicyStore, VersionConflict
from specgate.policies.document import DocumentError, PolicyDocument, loads
from specgate.validation import Invalid


def add_command(sub: Subcommands) -> None:
    policy = sub.add_parser("policy", help="the policy document in Redis", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = policy.add_subparsers(dest="policy_command", required=True)

    def command(name: str, help_text: str, *, store: bool = True) -> argparse.ArgumentParser:
        p = commands.add_parser(name, parents=[common_options()], help=help_text)
        if store:
            p.add_argument("--redis", metavar="URL", required=True, help="redis://host:port/db")
            p.add_argument("--prefix", default="specgate", help="key prefix (default: specgate)")
        p.set_defaults(func=_run)
        return p

    profile_help = "a profile from a file that the document may name (the gateways load it too)"
    p = command("validate", "check a document without touching Redis", store=False)
    p.add_argument("file", type=Path)
    p.add_argument("--profile-file", type=Path, action="append", default=[], metavar="FILE", help=profile_help)
    command("get", "print the current document")
    p = command("set", "make a document current")
    p.add_argument("file", type=Path)
    p.add_argument("--profile-file", type=Path, action="append", default=[], metavar="FILE", help=profile_help)
    p.add_argument("--why", default="", help="why: kept in the history")
    p.add_argument("--expect-version", type=int, help="write only if this is still the current version")
    command("history", "list the recorded changes, newest first").add_argument("--limit", type=int, default=20)
    p = command("rollback", "make an earlier version's document current again")
    p.add_argument("version", type=int)
    p.add_argument("--why", default="")
    command("diff", "what changed from VERSION to the current document").add_argument("version", type=int)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _read(args: argparse.Namespace) -> PolicyDocument:
    """The document of `args.file`, naming a built-in profile or one of `args.profile_file`."""
    try:
        _, profiles = profile_file.load_all(args.profile_file)
    except Invalid as exc:
        raise DocumentError("--profile-file", str(exc)) from None
    try:
        raw = args.file.read_bytes()
    except OSError as exc:
        raise DocumentError("(file)", f"cannot read {args.file}: {exc.strerror}") from None
    return loads(raw, profiles)


def _pretty(document: str) -> list[str]:
    return orjson.dumps(orjson.loads(document), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode().splitlines()


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


async def _get(store: PolicyStore, args: argparse.Namespace) -> int:
    current = await store.current()
    if current is None:
        print("specgate policy: no document in this store yet", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(orjson.dumps(current.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return 0


async def _set(store: PolicyStore, args: argparse.Namespace) -> int:
    document = _read(args)
    expected = args.expect_version
    if expected is None:
        current = await store.current()
        expected = current.version if current else 0
    stored = await store.write(document, expected_version=expected, who=_who(), why=args.why)
    print(f"specgate policy: version {stored.version} is current")
    return 0


async def _history(store: PolicyStore, args: argparse.Namespace) -> int:
    for record in await store.history(max(args.limit, 1)):
        policy = orjson.loads(record.document).get("policy", "?")
        print(f"{record.version:>6}  {_when(record.when)}  {policy:<16} {record.who}  {record.why}")
    return 0


async def _rollback(store: PolicyStore, args: argparse.Namespace) -> int:
    stored = await store.rollback(args.version, who=_who(), why=args.why)
    print(f"specgate policy: version {stored.version} is current (the document of version {args.version})")
    return 0


async def _diff(store: PolicyStore, args: argparse.Namespace) -> int:
    old, current = await store.at(args.version), await store.current()
    if old is None or current is None:
        print(f"specgate policy: version {args.version} is not in the history", file=sys.stderr)
        return 2
    lines = difflib.unified_diff(
        _pretty(old.document), _pretty(current.document), f"version {old.version}", f"version {current.version}",
        lineterm="",
    )  # fmt: skip
    for line in lines:
        print(line)
    return 0


_COMMANDS: dict[str, Callable[[PolicyStore, argparse.Namespace], Awaitable[int]]] = {
    "get": _get, "set": _set, "history": _history, "rollback": _rollback, "diff": _diff,
}  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    try:
        if args.policy_command == "validate":
            document = _read(args)
            print(f"specgate policy: valid ({document.policy}, profile {document.profile})")
            return 0
        return asyncio.run(_with_store(args))
    except DocumentError as exc:
        print(f"specgate policy: invalid document: {exc}", file=sys.stderr)
        return 2
    except VersionConflict as exc:
        print(f"specgate policy: {exc}", file=sys.stderr)
        return 3
    except KeyError as exc:
        print(f"specgate policy: {exc.args[0]}", file=sys.stderr)
        return 2
    except (*STORE_ERRORS, ValueError) as exc:
        print(f"specgate policy: cannot use the store at {args.redis}: {exc}", file=sys.stderr)
        return 1


async def _with_store(args: argparse.Namespace) -> int:
    store = PolicyStore.connect(args.redis, args.prefix)
    try:
        return await _COMMANDS[args.policy_command](store, args)
    finally:
        await store.close()
