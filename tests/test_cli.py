import pytest

from specgate.calibration.profiles import PROFILES, SOURCES
from specgate.cli import main


def test_list_profiles_prints_every_profile_and_its_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--list-profiles"]) == 0
    out = capsys.readouterr().out
    for name in PROFILES:
        assert name in out
    for key in SOURCES:
        assert f"{key}:" in out
    assert "tokens/step" in out


def test_unknown_profile_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--profile", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'nope'" in err
    assert "a100-codellama34b-tp2" in err


@pytest.mark.parametrize(
    "args",
    [
        ["sim", "--mode", "turbo"],
        ["sim", "--time-scale", "0"],
        ["sim", "--acceptance", "1.5"],
        ["sim", "--max-num-seqs", "0"],
        ["bench", "grid", "--quick", "--held-out", "--seed", "3"],  # (the quick cells are not a seed's draws)
        [],
    ],
)
def test_bad_arguments_exit_with_usage(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2


def test_impossible_engine_settings_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--kv-capacity-tokens", "1000"]) == 2
    assert "max_model_len" in capsys.readouterr().err
