"""Client keys: who may call, how often, how many at once, and with what rights."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from specgate.calibration.modes import Pool
from specgate.cli import main
from specgate.gateway.clients import ClientKey, Clients, check_rights, hashed, merged, parse_keys
from specgate.gateway.errors import Forbidden, Overloaded, Unauthorized
from specgate.validation import Invalid

KEY = "sg-secret"
ENTRY = ClientKey(name="a", sha256=hashed(KEY), rate_per_s=2.0, burst=2, max_concurrency=3)


def headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in values.items()}))


@pytest.mark.parametrize(
    "presented",
    [{"authorization": f"Bearer {KEY}"}, {"api_key": KEY}, {"x_api_key": KEY}, {"authorization": f"bearer  {KEY} "}],
)
def test_a_known_key_in_any_of_the_usual_headers(presented: dict[str, str]) -> None:
    assert Clients({ENTRY.sha256: ENTRY}).identify(headers(**presented)) is ENTRY


@pytest.mark.parametrize("presented", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                       {"authorization": "Bearer \udcff"}])  # fmt: skip
def test_no_known_key_is_a_401(presented: dict[str, str]) -> None:
    with pytest.raises(Unauthorized):
        Clients({ENTRY.sha256: ENTRY}).identify(headers(**presented))


def test_rate_and_concurrency_limits() -> None:
    clients = Clients({ENTRY.sha256: ENTRY})
    clients.admit(ENTRY, now=0.0)
    clients.admit(ENTRY, now=0.0)  # the burst of two
    with pytest.raises(Overloaded) as exc:
        clients.admit(ENTRY, now=0.1)
    assert exc.value.retry_after_s == pytest.approx(0.4)  # a token every half second: 0.4 s to the next
    assert exc.value.code == "rate_limited"
    clients.admit(ENTRY, now=0.5)  # refilled
    with pytest.raises(Overloaded) as exc:
        clients.admit(ENTRY, now=10.0)  # tokens enough, but three in flight already
    assert exc.value.code == "concurrency_limited"
    clients.release(ENTRY)
    clients.admit(ENTRY, now=10.0)


def test_rights_to_force_a_pool_and_claim_a_priority() -> None:
    check_rights(ENTRY, None, 0)
    with pytest.raises(Forbidden) as exc:
        check_rights(ENTRY, Pool.PLAIN, 0)
    assert exc.value.param == "x-route-pool"
    with pytest.raises(Forbidden):
        check_rights(ENTRY, None, 1)
    trusted = ClientKey(name="ops", sha256=hashed("x"), may_force_pool=True, max_priority=10)
    check_rights(trusted, Pool.PLAIN, 10)


def test_key_entries_are_checked_and_merged_by_name() -> None:
    with pytest.raises(Invalid) as exc:
        parse_keys([{"name": "a", "sha256": "not-a-hash"}], "auth.keys")
    assert exc.value.field == "auth.keys[0].sha256"
    with pytest.raises(Invalid):
        parse_keys([{"name": "a", "sha256": hashed("k"), "colour": "red"}], "auth.keys")
    old = parse_keys([{"name": "a", "sha256": hashed("old")}], "x")
    new = parse_keys([{"name": "a", "sha256": hashed("new")}], "y")
    assert list(merged(old, new)) == [hashed("new")]  # the later source wins: the key was rotated


def test_keys_new_prints_a_key_once_and_an_entry_that_holds_only_its_hash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["keys", "new", "team-a", "--rate-per-s", "5", "--json"]) == 0
    key, entry = capsys.readouterr().out.splitlines()
    assert key.startswith("sg-")
    assert key not in entry
    assert hashed(key) in entry
    assert main(["keys", "hash", key]) == 0
    assert capsys.readouterr().out.strip() == hashed(key)
