"""`train`'s typed config: files (flat or in sections), flag precedence, unknown keys with
suggestions, list and bool parsing (a flag's string converts, a file's value keeps its type), and every field checked
before anything loads (these tests run the real CLI parser and no model)."""

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

import pytest

from dflash_train.cli import build_parser, main
from dflash_train.commands.cache_features import CacheFeaturesConfig
from dflash_train.commands.eval import EvalConfig
from dflash_train.commands.quickstart import QuickstartConfig
from dflash_train.commands.regenerate import RegenerateConfig
from dflash_train.commands.self_prompts import SelfPromptsConfig
from dflash_train.config import (
    ConfigError,
    DrafterSpec,
    OptimizerSettings,
    TrainConfig,
    from_args,
    from_dict,
    leaf_fields,
    sections_of,
)


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
    assert (sections.optimizer.lr, sections.optimizer.steps, sections.model.block_size, sections.checkpoint.resume) == (1e-3, 12, 8, True)
    assert sections.data.data == ["a.jsonl", "b.jsonl"] and sections.data.seq_buckets == [256, 512]
    as_json = _config(tmp_path, [], json.dumps({"model": {"target": "t", "block_size": 8}, "lr": 1e-3, "steps": 12,
                                                "data": ["a.jsonl", "b.jsonl"], "seq_buckets": [256, 512],
                                                "max_seq_len": 512, "out": "run", "resume": True}), ".json")
    assert as_json == flat


def test_flags_override_the_file(tmp_path):
    config = _config(tmp_path, ["--lr", "2e-3", "--no-resume", "--data", "c.jsonl"],
                     '[optimizer]\nlr = 1e-3\nsteps = 7\n[checkpoint]\nout = "run"\nresume = true\n[data]\ndata = ["a.jsonl"]\n')
    assert config.optimizer.lr == 2e-3 and config.checkpoint.resume is False and config.data.data == ["c.jsonl"]
    assert config.optimizer.steps == 7 and config.checkpoint.out == "run"  # untouched by flags


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
    ('mode = "variants"\nvariants = [3]\n', "variants: cannot read 3 as a table"),
])
def test_file_errors_name_the_file_and_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as error:
        _config(tmp_path, [], text)
    assert "run.toml" in str(error.value)


@pytest.mark.parametrize("suffix, text, key, expected", [
    (".toml", '[checkpoint]\nresume = "yes"\n', "[checkpoint] resume", "true or false"),
    (".toml", 'fail_on_recompile = "false"\n', "fail_on_recompile", "true or false"),
    (".toml", '[optimizer]\nsteps = "3"\n', "[optimizer] steps", "an integer"),
    (".toml", 'lr = "1e-3"\n', "lr", "a number"),
    (".toml", "eval_bench = 3\n", "eval_bench", "a string"),
    (".toml", 'data = "a.jsonl"\n', "data", "a list of strings"),
    (".toml", 'seq_buckets = [256, "512"]\n', "seq_buckets", "an integer"),
    (".json", '{"checkpoint": {"resume": "true"}}', "[checkpoint] resume", "true or false"),
    (".json", '{"steps": "3"}', "steps", "an integer"),
])
def test_a_file_value_of_the_wrong_type_is_refused_where_a_flag_converts(tmp_path, capsys, suffix, text, key, expected):
    """Every flag arrives as a string, so `--steps 3` converts; a TOML or JSON file has booleans,
    numbers and lists of its own, so a string there is a mistake: `resume = "yes"` read as true,
    and `"false"` as false only by luck of spelling."""
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}: {key}: cannot read " in err and f"as {expected}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
    assert _config(tmp_path, ["--steps", "3", "--lr", "1e-3", "--seq-buckets", "256,512"]).optimizer.steps == 3


@pytest.mark.parametrize("old, new, where, expected", [
    ("cache = true", 'cache = "yes"', "[features]: cache", "true or false"),
    ("count = 160", 'count = "160"', "[prompts]: count", "an integer"),
    ('bench = ["mtbench", "humaneval"]', 'bench = "humaneval"', "[eval]: bench", "a list of strings"),
    ("steps = 160", 'steps = "160"', "[train]: steps", "an integer"),
])
def test_a_recipe_value_of_the_wrong_type_is_refused(tmp_path, old, new, where, expected):
    """A recipe is read by the config files' rule: before, `[features] cache = "yes"` cached."""
    from dflash_train.recipe import load_recipe, recipe_path

    source = recipe_path("quickstart").read_text()
    assert old in source
    recipe = tmp_path / "own.toml"
    recipe.write_text(source.replace(old, new, 1))
    with pytest.raises(ConfigError) as error:
        load_recipe(str(recipe))
    assert f"recipe {recipe}: {where}: cannot read " in str(error.value) and f"as {expected}" in str(error.value)


def test_an_unknown_key_without_a_close_match_lists_each_valid_key_once(tmp_path):
    """`data` is both a setting and the section holding it: listed once."""
    with pytest.raises(ConfigError, match="unknown key 'zzz'; valid keys: ") as error:
        _config(tmp_path, [], "zzz = 1\n")
    listed = str(error.value).split("valid keys: ")[1].split(", ")
    assert "data" in listed and "optimizer" in listed and "lr" in listed and len(listed) == len(set(listed))


def test_unknown_and_bad_flags_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["train", "--lrr", "1e-3"]) == 2
    assert "unknown argument '--lrr'; did you mean --lr?" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r"), "--steps", "many"]) == 2
    assert "--steps: cannot read 'many' as an integer" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r"), "--compile-target", "always"]) == 2
    assert "--compile-target 'always': use auto, on or off" in capsys.readouterr().err


def test_lists_and_bools_parse_from_flags(tmp_path):
    config = _config(tmp_path, ["--target-layer-ids", "1, 3,5", "--seq-buckets", "", "--drafter-devices", "cpu,cpu",
                                "--resume", "--fail-on-recompile", "--mask-token-id", "none", "--compile-target", "on"])
    assert config.parallel.compile_target == "on"
    assert config.model.target_layer_ids == [1, 3, 5] and config.data.seq_buckets == [] and config.parallel.drafter_devices == ["cpu", "cpu"]
    assert config.checkpoint.resume is True and config.parallel.fail_on_recompile is True and config.model.mask_token_id is None
    with pytest.raises(ConfigError, match="--target-layer-ids: cannot read 'x' as an integer"):
        _config(tmp_path, ["--target-layer-ids", "1,x"])


def test_a_home_path_after_a_comma_is_expanded_as_the_shell_expands_the_first(tmp_path, monkeypatch):
    # The shell turns `--bench ~/a.jsonl,~/b.jsonl` into `/home/u/a.jsonl,~/b.jsonl`: the items after a
    # comma come as typed, so each item's leading ~/ is expanded here; a ~ elsewhere is left alone.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _model_folders(tmp_path, t={"model_type": "llama"}, d={"dflash_config": {}})
    args = build_parser("eval").parse_args(["eval", "--target", "t", "--drafter", "d",
                                            "--bench", f"{tmp_path}/a.jsonl,~/b.jsonl,humaneval,x~/c.jsonl,~"])
    bench = from_args(EvalConfig, args).prompts.bench
    assert bench == [f"{tmp_path}/a.jsonl", f"{tmp_path}/b.jsonl", "humaneval", "x~/c.jsonl", str(tmp_path)]
    assert _config(tmp_path, ["--data", "~/one.jsonl,~/two.jsonl"]).data.data == [f"{tmp_path}/one.jsonl", f"{tmp_path}/two.jsonl"]


def test_variants_from_toml_are_typed_and_checked_like_flags(tmp_path):
    text = """
mode = "variants"
[[variants]]
name = "fast"
lr = 1e-3
block_size = 8
[[variants]]
name = "slow"
gamma = 4
"""
    config = _config(tmp_path, ["--out", "r"], text)
    (fast_name, fast), (slow_name, slow) = config.variant_configs()
    assert (fast_name, fast.optimizer.lr, fast.model.block_size) == ("fast", 1e-3, 8)  # numbers, not strings
    assert isinstance(fast.optimizer.lr, float) and isinstance(slow.objective.gamma, float)
    assert (slow_name, slow.optimizer.lr, slow.model.block_size) == ("slow", 6e-4, 16)
    for bad, match in [
        ('lr = "quick"', r"variants\[0\]: lr: cannot read 'quick' as a number"),
        ('lr = "1e-3"', r"run.toml: variants\[0\]: lr: cannot read '1e-3' as a number"),  # a file's value keeps its type
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
    (dict(target_layer_ids=[1, 3, 1]), "--target-layer-ids 1,3,1: a layer is named twice"),
    # Sizes no run can use: before, a traceback after the target loaded (OverflowError, MemoryError,
    # a 320 GB allocation), or a block longer than any row accepted silently.
    (dict(steps=10**23), "--steps must be in"),
    (dict(grad_accum=10**11), "--grad-accum must be in"),
    (dict(block_size=100_000), "--block-size must be in"),
    (dict(num_layers=100_000), "--num-layers must be in"),
    (dict(block_size=200, max_seq_len=128), "--block-size 200 is longer than --max-seq-len 128: no block fits in a row"),
])
def test_bad_values_are_refused_where_the_config_is_made(values, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(out="run", **values)
    with pytest.raises(ConfigError, match=match):  # deriving one is making one
        TrainConfig(out="run").replace(**values)


def test_dtype_aliases_are_accepted_as_their_names():
    for alias, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("bfloat16", "bfloat16")):
        assert TrainConfig(out="run", export_dtype=alias).checkpoint.export_dtype == name


def test_out_naming_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ConfigError, match="--out .*notes.txt is a file"):
        TrainConfig(out=str(path))
    assert path.read_text() == "mine"


def test_every_setting_has_one_section_and_one_flag(capsys):
    sections = sections_of(TrainConfig)
    assert list(sections) == ["data", "model", "objective", "optimizer", "parallel", "eval", "checkpoint", "logging"]
    listed = [name for names in sections.values() for name in names]
    fields = list(leaf_fields(TrainConfig))
    assert len(fields) > 50 and len(set(listed)) == len(listed) and sorted(listed) == sorted(fields)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for section in sections:
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


def test_flat_keywords_and_sections_make_the_same_config():
    dataclass_replace = dataclasses.replace  # by another name: the access codemod rewrites dataclasses.replace(config)
    flat = TrainConfig(out="run", lr=1e-3, steps=5, data=["a.jsonl"], max_seq_len=512)
    nested = TrainConfig(out="run", data=["a.jsonl"], max_seq_len=512, optimizer=OptimizerSettings(lr=1e-3, steps=5))
    assert flat == nested and flat.optimizer.lr == 1e-3 and flat.data.data == ["a.jsonl"]
    # replace() changes the files of the [data] section and keeps the section's other settings
    moved = flat.replace(data=["b.jsonl"], lr=2e-3)
    assert (moved.data.data, moved.data.max_seq_len, moved.optimizer.lr, moved.optimizer.steps) == (["b.jsonl"], 512, 2e-3, 5)
    with pytest.raises(TypeError, match=r"use config.replace\(data="):
        dataclass_replace(flat, data=["b.jsonl"])  # would silently drop max_seq_len
    assert dataclass_replace(flat, lr=3e-3).optimizer.lr == 3e-3
    with pytest.raises(TypeError, match="'lrr'"):
        TrainConfig(lrr=1e-3)


def test_a_config_that_exists_is_valid_and_stays_so():
    config = TrainConfig(out="run")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimizer.lr = -1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="--lr must be > 0"):
        OptimizerSettings(lr=-1.0)  # a section alone is checked where it is made too
    as_before: typing.Any = config  # code written for the flat layout
    with pytest.raises(AttributeError, match=r"it is config.optimizer.lr"):
        as_before.lr  # noqa: B018 - the flat name of the old layout points to its section


def test_the_flat_record_makes_the_same_config_again():
    """run.json and the checkpoints keep the settings flat by flag name (resume reads them)."""
    config = TrainConfig(out="run", lr=1e-3, mode="variants", variants=[{"name": "b8", "block_size": 8}, {"gamma": 4}])
    record = json.loads(json.dumps(config.flat_values()))
    assert record["lr"] == 1e-3 and record["variants"] == [{"name": "b8", "block_size": 8}, {"gamma": 4.0}]
    assert TrainConfig(**record) == config
    assert [name for name, _ in config.variant_configs()] == ["b8", "variant1"]


def test_a_variant_may_set_exactly_the_drafter_spec_settings():
    """DrafterSpec is the list of what a variant may change: each of its settings is a train
    setting of the same type, and a variant with any other key is refused naming the closest."""
    settings = leaf_fields(TrainConfig)
    hints = typing.get_type_hints(DrafterSpec)
    for name in DrafterSpec.settings():
        base = typing.get_args(hints[name])[0]  # `X | None`: None = the shared value
        declared = settings[name][1]
        assert base == (typing.get_args(declared)[0] if typing.get_origin(declared) in (typing.Union, types.UnionType)
                        else declared), name
    assert {"block_size", "lr", "fp8", "arch", "loss"} <= set(DrafterSpec.settings())
    for shared in ("steps", "batch_size", "data", "max_seq_len", "device", "mode"):
        assert shared not in DrafterSpec.settings()
        with pytest.raises(ConfigError, match=rf"variants\[0\]: unknown key '{shared}'"):
            TrainConfig(out="r", mode="variants", variants=[{"name": "v", shared: 1}])
    (_, drafter), = TrainConfig(out="r", mode="variants", lr=1e-3, variants=[DrafterSpec(name="v", lr=2e-3)]).variant_configs()
    assert drafter.optimizer.lr == 2e-3 and drafter.parallel.variants == []


def test_the_settings_nodes_compare_leave_out_exactly_the_per_node_ones():
    """Each node sets its own paths and devices (`option(per_node=True)`); every other setting,
    a variant's table included, must be equal on every node (compared by flag)."""
    from dflash_train.train.trainer import settings_every_node_shares

    config = TrainConfig(out="run", data=["a.jsonl"], device="cpu", lr=1e-3, mode="variants", variants=[{"name": "v"}])
    shared = settings_every_node_shares(config)
    for per_node in ("--out", "--data", "--device", "--target", "--drafter-devices", "--cuda-graphs", "--tensorboard"):
        assert per_node not in shared
    assert shared["--lr"] == 1e-3 and shared["--variants"] == [{"name": "v"}] and shared["--steps"] == 1000
    assert len(shared) == len(leaf_fields(TrainConfig)) - 14
    moved = settings_every_node_shares(config.replace(out="elsewhere", device="cuda:1", lr=2e-3))
    assert {key for key in shared if shared[key] != moved[key]} == {"--lr"}


@pytest.mark.parametrize("cls,at_least", [(TrainConfig, 20), (RegenerateConfig, 4), (EvalConfig, 2),
                                          (CacheFeaturesConfig, 2), (SelfPromptsConfig, 2), (QuickstartConfig, 1)],
                         ids=["train", "regenerate", "eval", "cache-features", "self-prompts", "quickstart"])
def test_product_code_reads_settings_through_their_sections(cls, at_least):
    """Every function of the package taking a config of sections reads `config.<section>.<setting>`:
    a flat read (`config.lr`, the old layout) would only fail when that line runs, some of them
    only on a GPU, so it is refused here by reading the source."""
    import ast
    from pathlib import Path

    import dflash_train

    allowed = set(sections_of(cls)) | {name for name in dir(cls) if not name.startswith("__")}
    settings = set(leaf_fields(cls))
    flat_reads, functions = [], 0
    for path in sorted(Path(dflash_train.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            params = {a.arg for a in args if a.annotation is not None and cls.__name__ in ast.unparse(a.annotation)}
            functions += bool(params)
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id in params
                        and inner.attr in settings and inner.attr not in allowed):
                    flat_reads.append(f"{path.name}:{inner.lineno}: {ast.unparse(inner)}")
    assert sections_of(cls)  # a flat config has no sections to read through
    assert functions >= at_least  # the walk found the command's functions
    assert not flat_reads, f"read these through their section (config.<section>.<setting>): {flat_reads}"


def _regenerate_config(tmp_path, argv, text):
    path = tmp_path / "answers.toml"
    path.write_text(text)
    return from_args(RegenerateConfig, build_parser("regenerate").parse_args(["regenerate", *argv, "--config", str(path)]))


def test_a_regenerate_file_in_sections_is_read_and_a_key_in_the_wrong_section_refused(tmp_path, capsys):
    out = str(tmp_path / "answers.jsonl")
    sections = _regenerate_config(tmp_path, ["--concurrency", "3"], f"""
out = "{out}"
[input]
prompts = "default"
limit = 7
split = "dev"
[generation]
seed = 5
temperature = 0.5
[server]
endpoint = "http://127.0.0.1:8000/v1"
concurrency = 9
retries = 2
""")
    assert (sections.input.limit, sections.input.split, sections.generation.seed, sections.generation.temperature) \
        == (7, "dev", 5, 0.5)
    assert (sections.server.retries, sections.server.concurrency, sections.output.out) == (2, 3, out)  # the flag wins
    flat = _regenerate_config(tmp_path, ["--concurrency", "3"], f'out = "{out}"\nprompts = "default"\nlimit = 7\n'
                              'split = "dev"\nseed = 5\ntemperature = 0.5\nendpoint = "http://127.0.0.1:8000/v1"\n'
                              'concurrency = 9\nretries = 2\n')
    assert flat == sections == RegenerateConfig(**sections.flat_values())
    assert sections_of(RegenerateConfig) == {
        "input": ("target", "prompts", "split", "limit", "thinking", "max_prompt_tokens"),
        "output": ("out", "flush_seconds"), "generation": ("max_new_tokens", "temperature", "top_p", "seed"),
        "local": ("batch_size", "device", "dtype"),
        "server": ("endpoint", "model", "concurrency", "request_timeout", "retries")}

    path = tmp_path / "wrong.toml"
    path.write_text('[input]\nprompts = "default"\nseed = 5\n')
    assert main(["regenerate", "--config", str(path), "--out", out, "--endpoint", "http://127.0.0.1:8000/v1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("wrong.toml: [input] seed: seed belongs in [generation]") and len(err.splitlines()) == 1
    assert not (tmp_path / "answers.jsonl").exists()


def _model_folders(root: Path, **configs: dict) -> None:
    """Folders named after the keys, each with that config.json, an empty weights file and a stub
    tokenizer: a target and a drafter are checked before anything loads, so they must be there."""
    from safetensors.torch import save_file

    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        save_file({}, str(root / name / "model.safetensors"))
        (root / name / "tokenizer_config.json").write_text("{}")


def test_an_eval_file_in_sections_is_read_flat_keys_still_are_and_the_record_stays_flat(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model_folders(tmp_path, t={"model_type": "llama"}, d={"dflash_config": {}})
    path = tmp_path / "eval.toml"
    path.write_text('target = "t"\n[models]\ndrafter = "d"\ndecoder = "hf"\n[prompts]\nbench = ["mtbench"]\n'
                    'offset = 2\n[decoding]\nstop_token_ids = [7]\nbaseline = false\n')
    config = from_args(EvalConfig, build_parser("eval").parse_args(["eval", "--config", str(path), "--limit", "4"]))
    assert (config.models.drafter, config.models.decoder, config.prompts.offset, config.prompts.limit) == ("d", "hf", 2, 4)
    assert config.decoding.stop_token_ids == [7] and config.decoding.baseline is False
    assert config == EvalConfig(target="t", drafter="d", decoder="hf", offset=2, limit=4, stop_token_ids=[7], baseline=False)
    assert config.flat_values()["offset"] == 2 and len(config.flat_values()) == len(leaf_fields(EvalConfig)) == 16
    assert config.models.compile_draft == "auto"
    # The hf decoder has no compiled drafter step: asking for one is refused before a model loads.
    with pytest.raises(ConfigError, match="--compile-draft on compiles the static decoder's drafter; --decoder hf"):
        from_args(EvalConfig, build_parser("eval").parse_args(["eval", "--config", str(path), "--compile-draft", "on"]))
    path.write_text('[prompts]\ntarget = "t"\n')
    with pytest.raises(ConfigError, match=r"eval.toml: \[prompts\] target: target belongs in \[models\]"):
        from_args(EvalConfig, build_parser("eval").parse_args(["eval", "--config", str(path)]))


def test_a_cache_features_file_in_sections_is_read_and_a_key_in_the_wrong_section_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model_folders(tmp_path, t={"model_type": "llama"})
    for name in ("a.jsonl", "b.jsonl"):  # --data files are checked before anything loads: they must exist
        (tmp_path / name).write_text("")
    path = tmp_path / "cache.toml"
    path.write_text('[input]\ntarget = "t"\ndata = ["a.jsonl", "b.jsonl"]\nmax_seq_len = 96\n[layers]\n'
                    'target_layer_ids = [1, 3]\n[output]\nout = "features"\nshard_size_mb = 8\n[compute]\nbatch_size = 2\n')
    argv = ["cache-features", "--config", str(path), "--num-layers", "2"]
    config = from_args(CacheFeaturesConfig, build_parser("cache-features").parse_args(argv))
    assert (config.input.data, config.input.max_seq_len, config.layers.target_layer_ids, config.layers.num_layers) \
        == (["a.jsonl", "b.jsonl"], 96, [1, 3], 2)
    assert (config.output.out, config.output.shard_size_mb, config.compute.batch_size) == ("features", 8.0, 2)
    assert config == CacheFeaturesConfig(target="t", data=["a.jsonl", "b.jsonl"], max_seq_len=96, target_layer_ids=[1, 3],
                                         num_layers=2, out="features", shard_size_mb=8, batch_size=2)
    path.write_text('target = "t"\ndata = ["a.jsonl", "b.jsonl"]\nmax_seq_len = 96\ntarget_layer_ids = [1, 3]\n'
                    'out = "features"\nshard_size_mb = 8\nbatch_size = 2\n')
    assert from_args(CacheFeaturesConfig, build_parser("cache-features").parse_args(argv)) == config  # flat keys still read

    path.write_text('[input]\ntarget = "t"\nnum_layers = 2\n')
    assert main(["cache-features", "--config", str(path), "--data", "a.jsonl", "--out", str(tmp_path / "features")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("cache.toml: [input] num_layers: num_layers belongs in [layers]") and len(err.splitlines()) == 1
    assert not (tmp_path / "features").exists()


def test_a_self_prompts_file_in_sections_is_read_and_a_key_in_the_wrong_section_refused(tmp_path, capsys):
    target, out = tmp_path / "target", tmp_path / "asked.jsonl"
    _model_folders(tmp_path, target={"model_type": "llama"})  # checked before anything loads: it must be a model folder
    path = tmp_path / "requests.toml"
    path.write_text(f'[input]\ntarget = "{target}"\n[output]\ncount = 12\nout = "{out}"\nsplit = "dev"\n'
                    '[generation]\nseed = 3\ntop_p = 0.5\n[local]\nbatch_size = 4\n')
    argv = ["self-prompts", "--config", str(path), "--max-new-tokens", "20"]
    config = from_args(SelfPromptsConfig, build_parser("self-prompts").parse_args(argv))
    assert (config.input.target, config.output.count, config.output.split, config.local.batch_size) \
        == (str(target), 12, "dev", 4)
    assert (config.generation.seed, config.generation.top_p, config.generation.max_new_tokens) == (3, 0.5, 20)
    assert config == SelfPromptsConfig(target=str(target), count=12, out=str(out), split="dev", seed=3, top_p=0.5,
                                       max_new_tokens=20, batch_size=4)
    assert (config.settings().count, config.settings().split, config.settings().seed) == (12, "dev", 3)
    path.write_text(f'target = "{target}"\ncount = 12\nout = "{out}"\nsplit = "dev"\nseed = 3\ntop_p = 0.5\n'
                    'batch_size = 4\n')
    assert from_args(SelfPromptsConfig, build_parser("self-prompts").parse_args(argv)) == config  # flat keys still read

    path.write_text('[generation]\ncount = 12\n')
    assert main(["self-prompts", "--config", str(path), "--target", str(target), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("requests.toml: [generation] count: count belongs in [output]") and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_quickstart_file_in_sections_is_read_and_a_key_in_the_wrong_section_refused(tmp_path, capsys):
    out = tmp_path / "quickstart"
    path = tmp_path / "quick.toml"
    path.write_text(f'[data]\nprompts = 40\nmax_new_tokens = 24\n[drafter]\ntarget_layer_ids = [1, 2]\nsteps = 20\n'
                    f'[eval]\neval_prompts = 2\n[run]\nout = "{out}"\nseed = 4\n')
    argv = ["quickstart", "--config", str(path), "--block-size", "4"]
    config = from_args(QuickstartConfig, build_parser("quickstart").parse_args(argv))
    assert (config.data.prompts, config.data.max_new_tokens, config.drafter.target_layer_ids, config.drafter.steps) \
        == (40, 24, [1, 2], 20)
    assert (config.drafter.block_size, config.eval.eval_prompts, config.run.out, config.run.seed) == (4, 2, str(out), 4)
    assert config == QuickstartConfig(prompts=40, max_new_tokens=24, target_layer_ids=[1, 2], steps=20, block_size=4,
                                      eval_prompts=2, out=str(out), seed=4)
    path.write_text(f'prompts = 40\nmax_new_tokens = 24\ntarget_layer_ids = [1, 2]\nsteps = 20\neval_prompts = 2\n'
                    f'out = "{out}"\nseed = 4\n')
    assert from_args(QuickstartConfig, build_parser("quickstart").parse_args(argv)) == config  # flat keys still read

    path.write_text('[data]\nsteps = 20\n')
    assert main(["quickstart", "--config", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("quick.toml: [data] steps: steps belongs in [drafter]") and len(err.splitlines()) == 1
    assert not out.exists()
