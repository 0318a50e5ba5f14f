"""One rule for numbers: every numeric setting of every command is a finite number inside the
range its config field declares, refused with one line naming the flag (exit 2) before anything
loads. The walk covers every command of the CLI table and every int/float field of its config."""

from __future__ import annotations

import importlib

import pytest

from dflash_train.cli import COMMANDS, main
from dflash_train.config import ConfigError, TrainConfig, check_numbers, from_dict, leaf_fields, numeric_fields

CONFIGS = {name: getattr(importlib.import_module(f"dflash_train.commands.{c.module}"), c.config)
           for name, c in COMMANDS.items()}
NUMERIC = [(command, name, kind) for command, cls in CONFIGS.items() for name, kind in numeric_fields(cls).items()]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _outside(bounds) -> list[str]:
    """Values just outside a field's range, as the user would type them."""
    values = []
    if bounds.low is not None:
        values.append(repr(bounds.low if bounds.low_open else bounds.low - 1))
    if bounds.high is not None:
        values.append(repr(bounds.high if bounds.high_open else bounds.high * 2 + 1))
    return values


def test_the_walk_sees_every_command_and_its_numbers():
    assert set(CONFIGS) == set(COMMANDS)
    assert len(NUMERIC) > 60  # train alone has ~30 numeric flags: the walk is not empty by accident
    assert ("regenerate", "flush_seconds", float) in NUMERIC and ("train", "dist_timeout", float) in NUMERIC


@pytest.mark.parametrize("command,name,kind", NUMERIC, ids=[f"{c}{_flag(n)}" for c, n, _ in NUMERIC])
def test_every_numeric_flag_refuses_nan_inf_and_out_of_range(command, name, kind, capsys):
    field = leaf_fields(CONFIGS[command])[name][0]
    bounds = field.metadata.get("range")
    assert bounds is not None, f"{command} {_flag(name)} declares no range: option(..., at_least=/above=/...)"
    for value in ["nan", "inf", "-inf", *_outside(bounds)]:
        code = main([command, f"{_flag(name)}={value}"])
        err = capsys.readouterr().err.strip()
        assert code == 2, (command, name, value, err)
        assert len(err.splitlines()) == 1 and _flag(name) in err, (command, name, value, err)


def test_a_config_file_and_a_variant_are_checked_by_the_same_rule(tmp_path):
    for text, flag in (("lr = nan\n", "--lr"), ("[optimizer]\nweight_decay = inf\n", "--weight-decay"),
                       ('mode = "variants"\nvariants = [{name = "a", clip_grad = inf}]\n', "--clip-grad")):
        path = tmp_path / "run.toml"
        path.write_text(text)
        code = main(["train", "--config", str(path), "--out", str(tmp_path / "run")])
        assert code == 2, text
    with pytest.raises(ConfigError, match=r"variants\[0\] \(a\): --clip-grad must be a finite number > 0"):
        from_dict(TrainConfig, {"out": "r", "mode": "variants", "variants": [{"name": "a", "clip_grad": float("inf")}]})
    with pytest.raises(ConfigError, match=r"--dist-timeout must be in \[1, 604800\] \(got 0.001\)"):
        TrainConfig(out="r", dist_timeout=0.001)  # B12: gloo's wait of 1 ms, refused as a flag


def test_every_default_is_inside_its_own_range():
    for cls in CONFIGS.values():
        check_numbers(cls())  # (a TrainConfig also checks itself where it is made)
