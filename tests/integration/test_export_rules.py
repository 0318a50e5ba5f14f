"""The loader-rule table (export.rules.RULES): our export passes every rule; every rule has a
folder that breaks it and only it (one real export, then one change per case); export stops on a
broken rule and writes nothing; `export --check DIR` judges any folder without writing."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dflash_train.export.hf import ExportError, export_model
from dflash_train.export.rules import ENGINES, RULES, TargetShape, check_folder, failures
from safetensors.torch import load_file, save_file
from tiny import FAMILIES, tiny_hf_model, tiny_target

from dflash_train.cli import main
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig

TARGET = TargetShape(hidden_size=64, num_hidden_layers=6, vocab_size=96,  # tiny_target's dims and rope
                     rope={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def valid_export(tmp_path_factory):
    target = tiny_target("qwen3")
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=5, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4])
    return export_model(DFlashDrafter(config), tmp_path_factory.mktemp("valid") / "export", dtype=torch.float32)


def _edit_config(change):
    def apply(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return apply


def _edit_weights(change):
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors"
        weights = load_file(str(path))
        change(weights)
        save_file(weights, str(path))
    return apply


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(config):
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return change


def _drop(*keys):
    def change(config):
        node = config
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
    return change


def _both(*changes):
    def change(config):
        for c in changes:
            c(config)
    return change


# (rule that must fail, what breaks it): each case changes one thing of the valid export.
BREAKS = {
    "architecture: another class": ("architecture", _edit_config(_set("architectures", ["Qwen3ForCausalLM"]))),
    "architecture: unknown model_type": ("architecture", _edit_config(_set("model_type", "dflash"))),
    "config_keys: head_dim left to a default": ("config_keys", _edit_config(_drop("head_dim"))),
    "config_keys: eps missing": ("config_keys", _edit_config(_drop("rms_norm_eps"))),
    "dflash_config: mask id only at the top level": ("dflash_config", _edit_config(_both(
        _drop("dflash_config", "mask_token_id"), _set("mask_token_id", 95)))),
    "dflash_config: block sizes disagree": ("dflash_config", _edit_config(_set("block_size", 8))),
    "dflash_config: no aux hidden states": ("dflash_config", _edit_config(_set("dflash_config", "use_aux_hidden_state", False))),
    "target_layer_ids: id past the target": ("target_layer_ids", _edit_config(_set("dflash_config", "target_layer_ids", [1, 3, 6]))),
    "target_layer_ids: eagle aux ids not shifted": ("target_layer_ids", _edit_config(_set("eagle_aux_hidden_state_layer_ids", [1, 3, 4]))),
    "mask_token_id: outside the table": ("mask_token_id", _edit_config(_set("dflash_config", "mask_token_id", 96))),
    "block_size: 1": ("block_size", _edit_config(_both(_set("block_size", 1), _set("dflash_config", "block_size", 1)))),
    "layer_types: one entry for two layers": ("layer_types", _edit_config(_set("layer_types", ["full_attention"]))),
    "layer_types: unknown type": ("layer_types", _edit_config(_set("layer_types", ["full_attention", "chunked_attention"]))),
    "layer_types: sliding without a window": ("layer_types", _edit_config(_set("layer_types", ["full_attention", "sliding_attention"]))),
    "causality: dflash_config.use_swa (vLLM slides every layer)": ("causality", _edit_config(_set("dflash_config", "use_swa", True))),
    "causality: dflash_config.causal (vLLM only)": ("causality", _edit_config(_set("dflash_config", "causal", True))),
    "hidden_act: gelu": ("hidden_act", _edit_config(_set("hidden_act", "gelu"))),
    "rope: theta left to the engine": ("rope", _edit_config(_both(_drop("rope_theta"), _drop("rope_parameters")))),
    "rope: thetas disagree": ("rope", _edit_config(_set("rope_theta", 1e6))),
    "rope: scaling types disagree": ("rope", _edit_config(_set("rope_scaling", {"rope_type": "linear", "factor": 2.0}))),
    "rope: neox style differs between engines": ("rope", _edit_config(_set("rope_is_neox_style", False))),
    "partial_rotary: a hybrid target's factor copied": ("partial_rotary", _edit_config(_set("rope_parameters", "partial_rotary_factor", 0.25))),
    "mrope: a hybrid target's sections copied": ("mrope", _edit_config(_set("rope_parameters", "mrope_section", [2, 3, 3]))),
    "target_rope: another theta everywhere": ("target_rope", _edit_config(_both(
        _set("rope_theta", 5e5), _set("rope_parameters", "rope_theta", 5e5)))),
    "weight_names: unknown name": ("weight_names", _edit_weights(lambda w: w.update(extra=torch.zeros(2)))),
    "weight_names: missing layer weight": ("weight_names", _edit_weights(lambda w: w.pop("layers.1.mlp.up_proj.weight"))),
    "weight_names: model. prefix": ("weight_names", _edit_weights(
        lambda w: w.update({f"model.{k}": w.pop(k) for k in list(w)}))),
    "weight_names: embedding": ("weight_names", _edit_weights(lambda w: w.update({"embed_tokens.weight": torch.zeros(96, 64)}))),
    "weight_names: LM head": ("weight_names", _edit_weights(lambda w: w.update({"lm_head.weight": torch.zeros(96, 64)}))),
    "weight_names: mask_hidden": ("weight_names", _edit_weights(lambda w: w.update({"mask_hidden": torch.zeros(64)}))),
    "fc_shape: two ids' width for three ids": ("fc_shape", _edit_weights(lambda w: w.update({"fc.weight": torch.zeros(64, 128)}))),
    "fc_shape: target_hidden_size (vLLM) differs from hidden_size (SGLang)": ("fc_shape", _edit_config(_set("target_hidden_size", 32))),
    "projection_shapes: q_norm of another head_dim": ("projection_shapes", _edit_weights(
        lambda w: w.update({"layers.0.self_attn.q_norm.weight": torch.zeros(12)}))),
    "finite: one NaN weight": ("finite", _edit_weights(lambda w: w["layers.0.mlp.up_proj.weight"].view(-1)[7].fill_(float("nan")))),
    "finite: an all-inf bfloat16 tensor": ("finite", _edit_weights(
        lambda w: w.update({"fc.weight": torch.full_like(w["fc.weight"], float("inf")).bfloat16()}))),
}


# DFlash2 folders: the DFlash2 rules judge them (a DFlash folder skips them), each broken alone.
DFLASH2_RULES = ("dflash2_config", "dflash2_shapes")
DFLASH2_BREAKS = {
    "dflash2_config: selector_rank only at the top level (vLLM reads dflash_config)": ("dflash2_config", _edit_config(
        _both(_drop("dflash_config", "selector_rank"), _set("selector_rank", 8)))),
    "dflash2_config: group size does not divide hidden": ("dflash2_config", _edit_config(
        _set("dflash_config", "conv_group_size", 24))),
    "dflash2_config: top-k past the vocabulary": ("dflash2_config", _edit_config(_set("dflash_config", "selector_top_k", 97))),
    "dflash2_config: no_rope_layers (vLLM 0.34 serves another drafter)": ("dflash2_config", _edit_config(
        _set("no_rope_layers", [1]))),
    "dflash2_shapes: codebook of another rank": ("dflash2_shapes", _edit_weights(
        lambda w: w.update({"candidate_selector.successor_codebook": torch.zeros(96, 4)}))),
    "dflash2_shapes: base kernel of other taps": ("dflash2_shapes", _edit_weights(
        lambda w: w.update({"layers.1.mlp_conv.base_kernel": torch.zeros(2, 2, 64)}))),
    "weight_names: a DFlash2 folder without its selector": ("weight_names", _edit_weights(
        lambda w: w.pop("candidate_selector.hidden_projection.weight"))),
}


@pytest.fixture(scope="module")
def valid_dflash2_export(tmp_path_factory):
    target = tiny_target("qwen3")
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=5, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4], arch="dflash2", conv_kernel_size=3,
                                       conv_group_size=16, selector_rank=8, selector_top_k=6)
    return export_model(DFlashDrafter(config), tmp_path_factory.mktemp("valid2") / "export", dtype=torch.float32)


def test_our_export_passes_every_rule(valid_export, valid_dflash2_export):
    verdicts = check_folder(valid_export, TARGET)
    assert [v.rule.name for v in verdicts] == [r.name for r in RULES]
    assert {v.rule.name: v.status for v in verdicts} == {r.name: "skip" if r.name in DFLASH2_RULES else "ok" for r in RULES}
    assert {v.rule.name: v.status for v in check_folder(valid_dflash2_export, TARGET)} == {r.name: "ok" for r in RULES}


@pytest.mark.parametrize("case", list(DFLASH2_BREAKS))
def test_a_dflash2_folder_breaking_one_rule_fails_only_that_rule(valid_dflash2_export, tmp_path, case):
    rule, breaks = DFLASH2_BREAKS[case]
    folder = tmp_path / "broken"
    shutil.copytree(valid_dflash2_export, folder)
    breaks(folder)
    failed = {v.rule.name: v.detail for v in failures(check_folder(folder, TARGET))}
    assert list(failed) == [rule], failed


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_exports_through_the_rules(tmp_path, family):
    target = tiny_target(family)
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=4, mask_token_id=90)
    out = export_model(DFlashDrafter(config), tmp_path / "export", dtype=torch.float32)
    shape = TargetShape(target.spec.hidden_size, target.spec.num_hidden_layers, target.spec.vocab_size)
    assert not failures(check_folder(out, shape))


def test_every_rule_has_a_case_that_breaks_it():
    assert {rule for rule, _ in [*BREAKS.values(), *DFLASH2_BREAKS.values()]} | {"target"} == {r.name for r in RULES}


@pytest.mark.parametrize("case", list(BREAKS))
def test_a_folder_breaking_one_rule_fails_only_that_rule(valid_export, tmp_path, case):
    rule, breaks = BREAKS[case]
    folder = tmp_path / "broken"
    shutil.copytree(valid_export, folder)
    breaks(folder)
    failed = {v.rule.name: v.detail for v in failures(check_folder(folder, TARGET))}
    assert list(failed) == [rule], failed


@pytest.mark.parametrize("target, words", [
    (TargetShape(64, 8, 96), "num_target_layers 6 but the target has 8"),
    (TargetShape(64, 6, 128), "vocab_size 96 but the target's is 128"),
    (TargetShape(96, 6, 96), "hidden_size 64 but the target's is 96"),
])
def test_the_target_rule_compares_against_a_known_target(valid_export, target, words):
    assert [v.rule.name for v in failures(check_folder(valid_export, target))] == ["target"]
    assert words in failures(check_folder(valid_export, target))[0].detail
    assert next(v for v in check_folder(valid_export) if v.rule.name == "target").status == "skip"


def test_without_num_target_layers_only_the_reference_misses_it(valid_export, tmp_path):
    """SGLang 0.5.23 bounds the ids by max(ids) + 1 when num_target_layers is absent; the reference
    reads config.num_target_layers: only the dflash_config rule fails, naming the key."""
    folder = tmp_path / "no-count"
    shutil.copytree(valid_export, folder)
    _edit_config(_both(_drop("num_target_layers"), _drop("dflash_config", "num_target_layers")))(folder)
    failed = {v.rule.name: v.detail for v in failures(check_folder(folder))}
    assert list(failed) == ["dflash_config"] and "num_target_layers" in failed["dflash_config"]


def test_is_causal_is_honoured_by_every_reader(valid_export, tmp_path):
    """SGLang 0.5.23 reads is_causal (_get_dflash_attention_type) as vLLM and the reference do:
    a causal drafter written with is_causal is served causally everywhere."""
    folder = tmp_path / "causal"
    shutil.copytree(valid_export, folder)
    _edit_config(_set("is_causal", True))(folder)
    assert not failures(check_folder(folder, TARGET))


CITATION = re.compile(r"(?P<engine>vLLM|SGLang|dflash|llama\.cpp) (?P<version>\S+) (?P<path>\S+\.py) (?P<symbol>[\w.\[\]']+)")


def test_every_rule_cites_where_each_engine_reads_it():
    for rule in RULES:
        citations = [part.strip() for part in rule.source.split(";")]
        assert citations and all(citations), rule.name
        for citation in citations:
            match = CITATION.fullmatch(citation)
            assert match, f"{rule.name}: {citation!r} is not 'ENGINE VERSION path.py symbol'"
            assert ENGINES[match["engine"]] == match["version"], f"{rule.name}: {citation!r} cites another release"
        engines = {CITATION.fullmatch(c)["engine"] for c in citations}
        assert {"vLLM", "SGLang"} & engines, f"{rule.name} cites neither serving engine"


def test_a_folder_laid_out_like_the_z_lab_releases_passes(valid_export, tmp_path):
    """z-lab's configs keep block_size / num_target_layers only at the top level and rope_theta
    without rope_parameters (transformers 4): every engine resolves them, so no rule fails."""
    folder = tmp_path / "z-lab-like"
    shutil.copytree(valid_export, folder)
    _edit_config(_both(_drop("dflash_config", "block_size"), _drop("dflash_config", "num_target_layers"),
                       _drop("rope_parameters"), _drop("dtype")))(folder)
    assert not failures(check_folder(folder, TARGET))


def test_export_stops_on_a_broken_rule_and_keeps_the_earlier_export(tmp_path):
    target = tiny_target("llama")
    good = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95)
    out = export_model(DFlashDrafter(good), tmp_path / "export", run_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = DrafterConfig(**{**good.to_dict(), "hidden_act": "gelu"})  # trains, but no engine serves it
    with pytest.raises(ExportError, match="hidden_act"):
        export_model(DFlashDrafter(bad), out, run_dir=tmp_path)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_check_command_prints_each_verdict_and_writes_nothing(valid_export, tmp_path, capsys):
    target_dir = tmp_path / "target"
    tiny_hf_model("qwen3").save_pretrained(target_dir)
    before = _tree(valid_export)
    assert main(["export", "--check", str(valid_export), "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    for rule in RULES:
        assert f"{'skip' if rule.name in DFLASH2_RULES else 'ok  '}  {rule.name}" in out
    assert "20 rules: 18 ok, 0 failed, 2 skipped" in out
    assert _tree(valid_export) == before

    broken = tmp_path / "broken"
    shutil.copytree(valid_export, broken)
    _edit_config(_set("hidden_act", "gelu"))(broken)
    assert main(["export", "--check", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  hidden_act" in out and "1 failed, 4 skipped" in out

    assert main(["export", "--check", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["export", "--check", str(valid_export), "--target", str(tmp_path)]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
    # A config.json that is not a JSON object: one line saying so, not every rule failing on it.
    for content, said in ((b"\xff\x00", "cannot be read as JSON"), (b"[1, 2]", "holds list, not a JSON object")):
        (broken / "config.json").write_bytes(content)
        assert main(["export", "--check", str(broken)]) == 2
        err = capsys.readouterr().err
        assert f"--check {broken}: its config.json {said}" in err and len(err.strip().splitlines()) == 1, err


def test_check_command_runs_without_torch(valid_export):
    code = ("import sys; from dflash_train.cli import main; rc = main(['export', '--check', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, str(valid_export)], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent.parent)
    assert result.returncode == 0, result.stderr
    assert "20 rules: 16 ok, 0 failed, 4 skipped" in result.stdout
