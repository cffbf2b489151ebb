"""Flags and EPDSERVE_* variables made from a config's fields (common/cli_fields.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from epdserve.common.cli_fields import add_fields, config_from, from_args, setting


@dataclass(frozen=True)
class Sub:
    name: str
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"sub.size: must be at least 1, got {self.size}")


@dataclass(frozen=True)
class Demo:
    model: str = setting(help="what to load", positional=True)
    max_num_seqs: int = setting(256, "most sequences")
    ratio: float = setting(0.5, "a share")
    limit: int | None = setting(None, "a bound")
    label: str | None = setting(None, "a name")
    role: str = setting("both", "a role", choices=("both", "prefill"))
    level: str = setting("info", "a level", choices=("info", "debug"), lower=True)
    caching: bool = setting(True, "on by default")
    verbose: bool = setting(False, "off by default")
    hosts: list[str] = setting([], "a list")
    endpoint: list[str] = setting([], "one per flag", repeat=True)
    derived: int = 0  # not a flag


def parse(*argv: str, env: dict | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_fields(parser, Demo, env or {})
    return parser.parse_args(list(argv))


def test_each_field_is_a_flag_named_after_it_and_plain_fields_are_not():
    parser = argparse.ArgumentParser()
    add_fields(parser, Demo, {})
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {
        "--max-num-seqs", "--ratio", "--limit", "--label", "--role", "--level", "--caching",
        "--no-caching", "--verbose", "--hosts", "--endpoint",
    }  # fmt: skip
    assert "EPDSERVE_MAX_NUM_SEQS" in parser.format_help()


def test_defaults_come_from_the_fields():
    args = parse("m")
    assert from_args(Demo, args) == Demo("m")


def test_the_environment_sets_a_value_and_a_flag_wins_over_it():
    env = {"EPDSERVE_MAX_NUM_SEQS": "64", "EPDSERVE_RATIO": "0.25", "EPDSERVE_MODEL": "env-m"}
    assert (parse(env=env).max_num_seqs, parse(env=env).ratio) == (64, 0.25)
    assert parse(env=env).model == "env-m"
    assert parse("cli-m", "--max-num-seqs", "8", env=env).max_num_seqs == 8
    assert parse("cli-m", env=env).model == "cli-m"


def test_an_empty_variable_counts_as_unset():
    config = from_args(Demo, parse("m", env={"EPDSERVE_LIMIT": "", "EPDSERVE_LABEL": ""}))
    assert (config.limit, config.label) == (None, None)


def test_an_empty_flag_for_an_optional_field_means_none():
    assert from_args(Demo, parse("m", "--label", "")).label is None


def test_switches_read_the_environment_and_one_on_by_default_can_be_turned_off():
    assert parse("m", env={"EPDSERVE_VERBOSE": "yes"}).verbose is True
    assert parse("m", env={"EPDSERVE_CACHING": "0"}).caching is False
    assert parse("m", "--no-caching").caching is False
    assert parse("m", "--verbose").verbose is True


def test_lists_split_the_variable_and_a_flag_replaces_it():
    env = {"EPDSERVE_HOSTS": "a b", "EPDSERVE_ENDPOINT": "x y"}
    assert parse("m", env=env).hosts == ["a", "b"]
    assert parse("m", "--hosts", "c", env=env).hosts == ["c"]
    assert parse("m", env=env).endpoint == ["x", "y"]
    assert parse("m", "--endpoint", "z", "--endpoint", "w", env=env).endpoint == ["z", "w"]


def test_a_bad_number_in_the_environment_exits_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("m", env={"EPDSERVE_MAX_NUM_SEQS": "many"})
    assert exc.value.code == 2
    assert "argument --max-num-seqs: invalid int value: 'many'" in capsys.readouterr().err


def test_a_variable_outside_the_choices_is_refused_naming_the_field():
    args = parse("m", env={"EPDSERVE_ROLE": "decode"})
    with pytest.raises(ValueError, match=r"^role: must be one of both, prefill, got 'decode'$"):
        from_args(Demo, args)


def test_case_insensitive_choices_are_lowered_from_flags_and_the_environment():
    assert parse("m", "--level", "DEBUG").level == "debug"
    assert from_args(Demo, parse("m", env={"EPDSERVE_LEVEL": "Debug"})).level == "debug"


def test_overrides_win_over_the_flags():
    assert from_args(Demo, parse("m"), model="other").model == "other"


def test_a_sub_config_is_built_from_text_or_a_dict_and_an_object_is_kept():
    assert config_from(Sub, '{"name": "a", "size": 2}', "sub") == Sub("a", 2)
    assert config_from(Sub, {"name": "a"}, "sub") == Sub("a")
    same = Sub("b")
    assert config_from(Sub, same, "sub") is same and config_from(Sub, None, "sub") is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("{", r"^sub: not valid JSON \("),
        ("[1]", r"^sub: must be a JSON object$"),
        ('{"name": "a", "colour": 1}', r"^sub\.colour: unknown key; known: \['name', 'size'\]$"),
        ('{"size": 2}', r"^sub\.name: required$"),
        ('{"name": "a", "size": 0}', r"^sub\.size: must be at least 1, got 0$"),
    ],
)
def test_sub_config_errors_name_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        config_from(Sub, value, "sub", required=("name",))
