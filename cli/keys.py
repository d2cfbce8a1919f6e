"""`specgate keys`: client keys for the gateway's [auth], made and hashed.

    specgate keys new NAME [--rate-per-s R] [--burst B] [--max-concurrency C] [--may-force-pool]
                           [--max-priority P]
    specgate keys hash KEY

`new` prints a fresh key once, on its own line, and then its entry (TOML, for a keys file or the
config's [auth] keys; JSON with --json, for SPECGATE_API_KEYS or Redis): the entry holds only the
key's SHA-256, so it can be stored and shared; the key itself cannot be recovered from it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any

from specgate.cli.arguments import Subcommands, common_options, positive_float, positive_int
from specgate.gateway.clients import ClientKey, hashed
from specgate.validation import Invalid, convert

KEY_PREFIX = "sg-"


def add_command(sub: Subcommands) -> None:
    keys = sub.add_parser("keys", help="client keys for [auth]", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = keys.add_subparsers(dest="keys_command", required=True)
    new = commands.add_parser("new", parents=[common_options()], help="a fresh key and its entry")
    new.add_argument("name")
    new.add_argument("--rate-per-s", type=positive_float)
    new.add_argument("--burst", type=positive_int)
    new.add_argument("--max-concurrency", type=positive_int)
    new.add_argument("--may-force-pool", action="store_true")
    new.add_argument("--max-priority", type=int, default=0)
    new.add_argument("--json", action="store_true", help="the entry as JSON rather than TOML")
    new.set_defaults(func=_new)
    digest = commands.add_parser("hash", parents=[common_options()], help="the SHA-256 a key is stored as")
    digest.add_argument("key")
    digest.set_defaults(func=lambda args: print(hashed(args.key)) or 0)


def _new(args: argparse.Namespace) -> int:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry: dict[str, Any] = {"name": args.name, "sha256": hashed(key), "may_force_pool": args.may_force_pool,
                             "max_priority": args.max_priority}  # fmt: skip
    for name in ("rate_per_s", "burst", "max_concurrency"):
        if getattr(args, name) is not None:
            entry[name] = getattr(args, name)
    try:
        convert(entry, ClientKey, root="key")
    except Invalid as exc:
        print(f"specgate keys: {exc}", file=sys.stderr)
        return 2
    print(key)
    if args.json:
        print(json.dumps(entry))
    else:
        print("[[keys]]")
        for name, value in entry.items():
            print(f"{name} = {json.dumps(value)}")
    return 0
