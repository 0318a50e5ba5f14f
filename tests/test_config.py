"""`train`'s typed config: files (flat or in sections), flag precedence, unknown keys with
suggestions, list and bool parsing, variants converted like flags, and every field checked
before anything loads (these tests run the real CLI parser and no model)."""

import argparse
import json

import pytest

from dflash_train.cli import build_parser, main
from dflash_train.config import ConfigError, TrainConfig, from_args, from_dict


def _config(tmp_path, argv, text=None, suffix=".toml"):
    """The TrainConfig the CLI builds from `argv` (+ a config file holding `text`)."""
    if text is not None:
        path = tmp_path / f"run{suffix}"
        path.write_text(text)
        argv = [*argv, "--config", str(path)]
    args = build_parser("train").parse_args(["train", *argv])
    return from_args(TrainConfig, args)


def test_a_file_in_sections_or_flat_gives_the_same_config(tmp_path):
    sections = _config(tmp_path, [], """
[model]
target = "t"
block_size = 8
[optimizer]
lr = 1e-3
steps = 12
[data]
data = ["a.jsonl", "b.jsonl"]
seq_buckets = [256, 512]
max_seq_len = 512
[checkpoint]
out = "run"
resume = true
""")
    flat = _config(tmp_path, [], 'target = "t"\nblock_size = 8\nlr = 1e-3\nsteps = 12\ndata = ["a.jsonl", "b.jsonl"]\n'
                                 'seq_buckets = [256, 512]\nmax_seq_len = 512\nout = "run"\nresume = true\n')
    assert sections == flat
    assert (sections.lr, sections.steps, sections.block_size, sections.resume) == (1e-3, 12, 8, True)
    assert sections.data == ["a.jsonl", "b.jsonl"] and sections.seq_buckets == [256, 512]
    as_json = _config(tmp_path, [], json.dumps({"model": {"target": "t", "block_size": 8}, "lr": 1e-3, "steps": 12,
                                                "data": ["a.jsonl", "b.jsonl"], "seq_buckets": [256, 512],
                                                "max_seq_len": 512, "out": "run", "resume": True}), ".json")
    assert as_json == flat


def test_flags_override_the_file(tmp_path):
    config = _config(tmp_path, ["--lr", "2e-3", "--no-resume", "--data", "c.jsonl"],
                     '[optimizer]\nlr = 1e-3\nsteps = 7\n[checkpoint]\nout = "run"\nresume = true\n[data]\ndata = ["a.jsonl"]\n')
    assert config.lr == 2e-3 and config.resume is False and config.data == ["c.jsonl"]
    assert config.steps == 7 and config.out == "run"  # untouched by flags


@pytest.mark.parametrize("text,match", [
    ('[optimizer]\nlrr = 1e-3\n', r"\[optimizer\]: unknown key 'lrr'; did you mean 'lr'\?"),
    ('lerning_rate = 1e-3\n', "unknown key 'lerning_rate'"),
    ('bach_size = 4\n', "did you mean 'batch_size'"),
    ('[optimiser]\nlr = 1e-3\n', "unknown key 'optimiser'; did you mean 'optimizer'"),
    ('[data]\nlr = 1e-3\n', r"\[data\] lr: lr belongs in \[optimizer\]"),
    ('lr = 1e-3\n[optimizer]\nlr = 2e-3\n', "lr is set twice"),
    ('[optimizer]\nlr = "fast"\n', r"\[optimizer\] lr: cannot read 'fast' as a number"),
    ('steps = true\n', "steps: cannot read True as an integer"),  # not one step
    ('steps = 2.5\n', "steps: cannot read 2.5 as an integer"),
    ('resume = "maybe"\n', "resume: cannot read 'maybe' as true or false"),
    ('[data]\ndata = 3\n', r"\[data\] data: cannot read 3 as a list of strings"),
    ('data = [\n', "run.toml"),  # a TOML syntax error names the file
])
def test_file_errors_name_the_file_and_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as error:
        _config(tmp_path, [], text)
    assert "run.toml" in str(error.value)


def test_unknown_and_bad_flags_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["train", "--lrr", "1e-3"]) == 2
    assert "unknown argument '--lrr'; did you mean --lr?" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r"), "--steps", "many"]) == 2
    assert "--steps: cannot read 'many' as an integer" in capsys.readouterr().err


def test_lists_and_bools_parse_from_flags(tmp_path):
    config = _config(tmp_path, ["--target-layer-ids", "1, 3,5", "--seq-buckets", "", "--drafter-devices", "cpu,cpu",
                                "--resume", "--fail-on-recompile", "--mask-token-id", "none"])
    assert config.target_layer_ids == [1, 3, 5] and config.seq_buckets == [] and config.drafter_devices == ["cpu", "cpu"]
    assert config.resume is True and config.fail_on_recompile is True and config.mask_token_id is None
    with pytest.raises(ConfigError, match="--target-layer-ids: cannot read 'x' as an integer"):
        _config(tmp_path, ["--target-layer-ids", "1,x"])


def test_variants_from_toml_are_converted_and_checked_like_flags(tmp_path):
    text = """
mode = "variants"
[[variants]]
name = "fast"
lr = "1e-3"
block_size = "8"
[[variants]]
name = "slow"
gamma = 4
"""
    config = _config(tmp_path, ["--out", "r"], text)
    (fast_name, fast), (slow_name, slow) = config.variant_configs()
    assert (fast_name, fast.lr, fast.block_size) == ("fast", 1e-3, 8)  # numbers, not strings
    assert isinstance(fast.lr, float) and isinstance(slow.gamma, float)
    assert (slow_name, slow.lr, slow.block_size) == ("slow", 6e-4, 16)
    for bad, match in [
        ('lr = "quick"', r"variants\[0\]: lr: cannot read 'quick' as a number"),
        ("lr = -1e-3", r"variants\[0\] \(v\): --lr must be > 0"),
        ("block_sise = 8", r"variants\[0\]: unknown key 'block_sise'; did you mean 'block_size'"),
        ("steps = 5", r"variants\[0\]: unknown key 'steps'"),  # shared by construction
    ]:
        with pytest.raises(ConfigError, match=match):
            _config(tmp_path, ["--out", "r"], f'mode = "variants"\n[[variants]]\nname = "v"\n{bad}\n')


@pytest.mark.parametrize("values,match", [
    (dict(clip_grad=-1.0), "--clip-grad must be > 0"),
    (dict(clip_grad=0.0), "--clip-grad must be > 0"),
    (dict(lr=-1e-3), "--lr must be > 0"),
    (dict(lr=float("nan")), "--lr must be a finite number > 0"),
    (dict(gamma=-7.0), "--gamma must be > 0"),
    (dict(gamma=0.0), "--gamma must be > 0"),
    (dict(export_dtype="int8"), "--export-dtype 'int8': use bfloat16, float16, float32"),
    (dict(seq_buckets=[512, 256]), "--seq-buckets 512,256: lengths must be increasing"),
    (dict(seq_buckets=[256, 256]), "must be increasing"),
    (dict(seq_buckets=[1024, 4096]), "--seq-buckets 4096 is longer than --max-seq-len 2048"),
    (dict(weight_decay=-0.1), "--weight-decay must be at least 0"),
    (dict(adam_beta2=1.0), r"--adam-beta2 must be in \[0, 1\)"),
    (dict(thinking="maybe"), "--thinking 'maybe': use auto, on or off"),
    (dict(min_lr_ratio=2.0), "--min-lr-ratio"),
    (dict(keep_checkpoints=0), "--keep-checkpoints must be at least 1"),
    (dict(stop_after_bad_steps=-1), "--stop-after-bad-steps must be at least 0"),
])
def test_bad_values_are_refused_by_validate(values, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(out="run", **values).validate()


def test_dtype_aliases_are_accepted_as_their_names():
    for alias, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("bfloat16", "bfloat16")):
        config = TrainConfig(out="run", export_dtype=alias)
        config.validate()
        assert config.export_dtype == name


def test_out_naming_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ConfigError, match="--out .*notes.txt is a file"):
        TrainConfig(out=str(path)).validate()
    assert path.read_text() == "mine"


def test_every_field_has_one_section_and_one_flag(capsys):
    import dataclasses

    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    listed = [name for names in TrainConfig.SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(fields) and len(set(listed)) == len(listed)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for section in TrainConfig.SECTIONS:
        assert f"[{section}]:" in help_text
    parser = argparse.ArgumentParser()
    from dflash_train.config import add_arguments

    add_arguments(parser, TrainConfig)
    flags = {a.dest for a in parser._actions} - {"help", "config"}
    assert flags == set(fields)


def test_from_dict_validates():
    with pytest.raises(ConfigError, match="--loss 'ce': use decay or dpace"):
        from_dict(TrainConfig, {"out": "r", "objective": {"loss": "ce"}})


def test_a_json_config_with_a_key_set_twice_is_refused(tmp_path):
    """TOML refuses a key given twice; JSON used to keep the last one silently (D13)."""
    for text in ('{"lr": 1e-3, "steps": 5, "lr": 3}', '{"optimizer": {"lr": 1e-3, "lr": 3}}'):
        with pytest.raises(ConfigError, match=r"run.json: lr is set twice"):
            _config(tmp_path, [], text, suffix=".json")


def test_variants_without_mode_variants_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`variants` is given but --mode is replicas: add mode = \"variants\""):
        _config(tmp_path, ["--out", "r"], 'variants = [{name = "b8", block_size = 8}]\n')


def test_a_config_file_that_is_not_utf8_is_one_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"lr = 1\xff\n")
    with pytest.raises(ConfigError, match=r"run.toml: not UTF-8 text \(byte 6\)"):
        from_args(TrainConfig, build_parser("train").parse_args(["train", "--config", str(path)]))
