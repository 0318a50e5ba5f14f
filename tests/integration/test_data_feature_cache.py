"""The offline feature cache with a real (tiny, random-init) target and the real SmolLM2 tokenizer:
cached and live features train identically, the writer resumes, corruption is caught on read."""

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from data_files import DATA, REGENERATED_64
from safetensors.torch import load_file
from test_generate_regenerate import tiny_smollm_dir

from dflash_train.cli import main as cli_main
from dflash_train.config import ConfigError, TrainConfig
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.data.feature_cache import FeatureCache, FeatureCacheError, write_feature_cache
from dflash_train.data.samples import load_training_samples
from dflash_train.target.model import load_target
from dflash_train.train.batches import BatchPlanner
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.supply import LiveTarget
from dflash_train.train.trainer import train

MAX_LEN = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory):
    return tiny_smollm_dir(smollm2_dir, tmp_path_factory.mktemp("tiny"), layers=6)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_target(tiny_dir, "cpu")


@pytest.fixture(scope="module")
def samples(tiny):
    return load_training_samples(REGENERATED_64, tiny.tokenizer, max_length=MAX_LEN, min_supervised_tokens=2)


def _quiet():
    return open(os.devnull, "w")


def _write(tiny, samples, out, layer_ids=(1, 2, 3), dtype=torch.float32, shard_size_mb=0.5, **kw):
    rows, stats = samples
    return write_feature_cache(tiny, rows, stats, out, layer_ids=list(layer_ids), dtype=dtype, batch_size=4,
                               shard_size_mb=shard_size_mb, settings={"max_seq_len": MAX_LEN, "data": [str(REGENERATED_64)]},
                               log=kw.pop("log", _quiet()), progress_stream=_quiet(), **kw)


@pytest.fixture(scope="module")
def cache_dir(tiny, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "features"
    _write(tiny, samples, out)
    return out


def test_cache_holds_what_the_target_computes(tiny, samples, cache_dir):
    cache = FeatureCache(cache_dir)
    rows, stats = samples
    assert len(cache) == len(rows) == stats.used and cache.layer_ids == [1, 2, 3] and cache.width == 3 * 64
    assert len(list(cache_dir.glob("shard-*.bin"))) > 3  # sharded, not one file per sample
    for sample, cached in zip(rows, cache.samples()):
        assert cached.sample_id == sample.sample_id and cached.source == sample.source
        assert torch.equal(cached.input_ids, sample.input_ids) and torch.equal(cached.loss_mask, sample.loss_mask)
    for sample in rows[:6]:
        live = tiny.features(sample.input_ids[None], [1, 2, 3])[0]
        torch.testing.assert_close(cache.features_of(sample.sample_id), live, rtol=1e-5, atol=1e-5)
    # The source pads each row of a planned batch with zeros, and picks a subset of layers.
    planner = BatchPlanner(cache.samples(), batch_size=4, batches_per_step=1, buckets=[128, MAX_LEN], seed=0,
                           objectives={"d": ObjectiveConfig(block_size=4, num_anchors=8)}, pad_id=2)
    batch = planner.step_batches(0)[0]
    from_cache = cache.source("cpu", [3, 1]).features(batch)
    live = LiveTarget(tiny, [3, 1]).features(batch)
    assert from_cache.shape == live.shape and from_cache.dtype == torch.float32
    for i, length in enumerate(batch.lengths.tolist()):
        torch.testing.assert_close(from_cache[i, :length], live[i, :length], rtol=1e-5, atol=1e-5)
        assert not from_cache[i, length:].any()


def _train_config(out, **overrides):
    values = dict(out=str(out), steps=3, batch_size=4, max_seq_len=MAX_LEN, block_size=4, num_layers=1, num_anchors=16,
                  target_layer_ids=[1, 3], lr=3e-3, log_every=1, save_every=3, device="cpu", seed=0, export_dtype="")
    values.update(overrides)
    return TrainConfig(**values)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "drafter.safetensors"))


def test_training_from_cache_equals_training_from_the_live_target(tiny_dir, cache_dir, tmp_path):
    log = tmp_path / "cached.log"
    with open(log, "w") as handle:
        train(_train_config(tmp_path / "cached", features=str(cache_dir)), log=handle)
    train(_train_config(tmp_path / "live", target=str(tiny_dir), data=[str(REGENERATED_64)]), log=_quiet())
    cached_losses, live_losses = _losses(tmp_path / "cached"), _losses(tmp_path / "live")
    assert len(cached_losses) == 3
    assert cached_losses == pytest.approx(live_losses, rel=1e-5, abs=1e-6)
    cached_weights, live_weights = _weights(tmp_path / "cached"), _weights(tmp_path / "live")
    for name in live_weights:
        torch.testing.assert_close(cached_weights[name], live_weights[name], rtol=1e-4, atol=1e-6)
    text = log.read_text()
    assert "rows: read=64 used=55 skipped=9" in text  # accounted from the data files the cache was made from
    assert "features from" in text and f"features: cache {cache_dir}" in text
    # The comparison can fail: other target layers give other weights after the same 3 steps.
    train(_train_config(tmp_path / "other", target=str(tiny_dir), data=[str(REGENERATED_64)], target_layer_ids=[1, 2]), log=_quiet())
    other = _weights(tmp_path / "other")
    assert any(not torch.allclose(other[name], live_weights[name], rtol=1e-4, atol=1e-6) for name in live_weights)


def test_bfloat16_cache_trains_close_to_live(tiny, samples, tiny_dir, tmp_path):
    out = tmp_path / "bf16"
    _write(tiny, samples, out, layer_ids=[1, 3], dtype=torch.bfloat16, shard_size_mb=64)
    assert FeatureCache(out).dtype == torch.bfloat16
    size = sum(p.stat().st_size for p in out.glob("shard-*.bin"))
    tokens = sum(len(s.input_ids) for s in samples[0])
    assert tokens * (2 * 64 * 2 + 5) <= size < tokens * (2 * 64 * 2 + 5) + 64 * len(samples[0])
    train(_train_config(tmp_path / "cached", features=str(out)), log=_quiet())
    train(_train_config(tmp_path / "live", target=str(tiny_dir), data=[str(REGENERATED_64)]), log=_quiet())
    assert _losses(tmp_path / "cached") == pytest.approx(_losses(tmp_path / "live"), rel=1e-3)


def test_training_errors_name_the_layers_and_the_conflict(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"needs target layers \[0, 3\] but the feature cache .* holds layers \[1, 2, 3\] \(missing \[0\]\)"):
        train(_train_config(tmp_path / "a", features=str(cache_dir), target_layer_ids=[0, 3]), log=_quiet())
    with pytest.raises(ConfigError, match="pass --data or --features, not both"):
        train(_train_config(tmp_path / "b", features=str(cache_dir), data=[str(REGENERATED_64)]), log=_quiet())


def test_writer_resumes_keeping_complete_shards_and_rewriting_a_partial_one(tiny, samples, cache_dir, tmp_path):
    out = tmp_path / "resumed"
    _write(tiny, samples, out)
    shards = sorted(out.glob("shard-*.bin"))
    assert len(shards) >= 4
    # What a kill leaves: the header not yet complete, the last shards never indexed, one .bin cut short, a temp file.
    header = json.loads((out / "cache.json").read_text())
    (out / "cache.json").write_text(json.dumps({**header, "complete": False}))
    for shard in shards[-2:]:
        shard.with_suffix(".json").unlink()
    with open(shards[-1], "r+b") as handle:
        handle.truncate(shards[-1].stat().st_size // 3)
    (out / "shard-00001.json.tmp").write_text("{")
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache(out)
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards[:-2]}
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        report = _write(tiny, samples, out, log=handle)
    text = log.read_text()
    assert "removing shard-00001.json.tmp" in text and f"removing {shards[-1].name}" in text
    assert report.samples_kept + report.samples_written == len(samples[0]) and report.samples_kept > 0
    assert report.samples_written == len(samples[0]) - sum(
        len(json.loads(p.with_suffix(".json").read_text())["samples"]) for p in kept)
    for path, identity in kept.items():
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity  # not rewritten
    resumed, reference = FeatureCache(out), FeatureCache(cache_dir)
    assert [s.sample_id for s in resumed.samples()] == [s.sample_id for s in reference.samples()]
    for sample in reference.samples():
        torch.testing.assert_close(resumed.features_of(sample.sample_id), reference.features_of(sample.sample_id), rtol=1e-5, atol=1e-5)


def test_writer_refuses_other_settings_and_changed_data(tiny, samples, cache_dir, tmp_path):
    with pytest.raises(FeatureCacheError, match=r"layer_ids: \[1, 2, 3\] before, \[1, 3\] now"):
        _write(tiny, samples, cache_dir, layer_ids=[1, 3])
    out = tmp_path / "changed"
    _write(tiny, samples, out)
    rows, stats = samples
    altered = [rows[0].__class__(s.sample_id, s.input_ids.flip(0), s.loss_mask, s.source) if s is rows[0] else s for s in rows]
    with pytest.raises(FeatureCacheError, match="no longer renders to the same tokens"):
        _write(tiny, (altered, stats), out)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FeatureCacheError, match="not empty and holds no feature cache"):
        _write(tiny, samples, tmp_path / "busy")


def _first_entry(directory: Path):
    index_file = sorted(directory.glob("shard-*.json"))[1]
    return index_file, json.loads(index_file.read_text())["samples"][0]


def test_flipped_feature_byte_is_caught_on_first_read(tiny, samples, tmp_path):
    out = tmp_path / "corrupt"
    _write(tiny, samples, out)
    index_file, entry = _first_entry(out)
    shard = index_file.with_suffix(".bin")
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 1000] ^= 0x01  # one bit of one float of the features
    shard.write_bytes(bytes(data))
    cache = FeatureCache(out)  # tokens are intact: opening works
    other = next(s.sample_id for s in cache.samples() if s.sample_id != entry["id"])
    cache.features_of(other)
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}: sample {entry['id']} \(.*\): feature checksum mismatch"):
        cache.features_of(entry["id"])


def test_flipped_token_byte_and_truncation_are_caught_on_open(tiny, samples, tmp_path):
    out = tmp_path / "corrupt"
    _write(tiny, samples, out)
    index_file, entry = _first_entry(out)
    shard = index_file.with_suffix(".bin")
    data = bytearray(shard.read_bytes())
    position = entry["offset"] + entry["length"] * 3 * 64 * 4  # the first input id
    data[position] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}, sample {entry['id']} .*token checksum mismatch"):
        FeatureCache(out)
    data[position] ^= 0x01
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(FeatureCacheError, match=rf"{shard.name}: {len(data) - 10} bytes on disk, its index says {len(data)}"):
        FeatureCache(out)
    assert zlib.crc32(bytes(data)) != 0  # (the intact file is the one the index describes)


def test_cli_prints_the_size_estimate_first_and_rows_last(tiny_dir, tmp_path, capsys):
    out = tmp_path / "cli-cache"
    args = ["cache-features", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out", str(out),
            "--max-seq-len", str(MAX_LEN), "--num-layers", "2", "--device", "cpu", "--shard-size-mb", "1"]
    assert cli_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    estimate = next(i for i, line in enumerate(lines) if line.startswith("size estimate:"))
    summary = lines.index("cache-features summary")
    assert estimate < summary
    assert "55 samples" in lines[estimate] and "2 layers x 64 hidden x 4 bytes float32" in lines[estimate]
    assert lines[-2:] == ["rows: read=64 used=55 skipped=9 (of the used, 20 truncated to the length kept)",
                          f"  skipped 9: no valid anchor  (first: {REGENERATED_64}:5)"]
    cache = FeatureCache(out)
    assert cache.layer_ids == [1, 3] and len(cache) == 55  # the SEMANTICS.md rule for 6 layers, n = 2
    # Running it again finds everything written and writes nothing.
    assert cli_main(args) == 0
    assert "this run    0 samples" in capsys.readouterr().out
    assert cli_main(["cache-features", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out", str(out),
                     "--shard-size-mb", "0"]) == 2
    assert "--shard-size-mb must be in (0, 1048576]" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_source_matches_cpu(cache_dir):
    cache = FeatureCache(cache_dir)
    planner = BatchPlanner(cache.samples(), batch_size=4, batches_per_step=1, buckets=[128, MAX_LEN], seed=0,
                           objectives={"d": ObjectiveConfig(block_size=4, num_anchors=8)}, pad_id=2)
    batch = planner.step_batches(0)[0]
    on_gpu = cache.source("cuda:0", [1, 3], dtype=torch.float32).features(batch)
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), cache.source("cpu", [1, 3]).features(batch), rtol=0, atol=0)


def test_thinking_must_match_the_cache(cache_dir, tmp_path):
    """The evaluator renders its prompts in the cache's thinking mode; another explicit
    --thinking is refused before any model loads (--thinking auto takes the cache's)."""
    with pytest.raises(ConfigError, match="--thinking off: the feature cache .* was rendered with thinking auto"):
        train(_train_config(tmp_path / "a", features=str(cache_dir), thinking="off", eval_every=1), log=_quiet())
    assert not (tmp_path / "a" / "run.json").exists()


@pytest.mark.gpu
def test_gpu_training_from_cache_evaluates_on_the_gpu(tiny_dir, cache_dir, tmp_path):
    """--features with --eval-every on a GPU: the in-training evaluator decodes with a target on
    the GPU, not on the CPU inside the drafter thread."""
    seen = {}

    def where(worker, step):
        if worker.setup.evaluation is not None:
            seen["device"] = worker.setup.evaluation.evaluator.target.device

    prompts = DATA / "eval_prompts.jsonl"
    train(_train_config(tmp_path, features=str(cache_dir), target=str(tiny_dir), device="cuda", eval_every=3,
                        eval_bench=str(prompts), eval_limit=1, eval_max_new_tokens=8), log=_quiet(), step_hook=where)
    assert seen["device"].type == "cuda"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "tau_real" in records[-1]


def test_train_refuses_a_cache_made_from_another_target(tiny_dir, cache_dir, tmp_path):
    """The same shape with other weights (a fine-tune) is refused before the target loads, naming
    both; the cache's own target trains; a cache from before the identity was recorded is
    accepted with a note (refusing it would throw away hours of target forwards)."""
    from test_parallel_nodes import _noisy_copy

    other = _noisy_copy(Path(tiny_dir), tmp_path / "fine-tune")
    assert json.loads((cache_dir / "cache.json").read_text())["target_identity"]["path"] == str(Path(tiny_dir).resolve())
    with pytest.raises(FeatureCacheError, match=rf"--target {other} is not the target the feature cache {cache_dir} was "
                                                rf"made from \({Path(tiny_dir).resolve()}\): their sampled weights differ"):
        train(_train_config(tmp_path / "refused", features=str(cache_dir), target=str(other)), log=_quiet())
    assert not (tmp_path / "refused").exists()
    train(_train_config(tmp_path / "same", features=str(cache_dir), target=str(tiny_dir), steps=1), log=_quiet())
    older = tmp_path / "older"
    shutil.copytree(cache_dir, older)
    header = json.loads((older / "cache.json").read_text())
    del header["target_identity"]
    (older / "cache.json").write_text(json.dumps(header))
    log = tmp_path / "older.log"
    with open(log, "w") as handle:
        train(_train_config(tmp_path / "old", features=str(older), target=str(other), steps=1), log=handle)
    assert f"the feature cache {older} records no target identity" in log.read_text()


def test_writer_refuses_to_resume_with_another_target(tiny, samples, tiny_dir, tmp_path):
    from test_parallel_nodes import _noisy_copy

    out = tmp_path / "cache"
    _write(tiny, samples, out)
    other = load_target(_noisy_copy(Path(tiny_dir), tmp_path / "fine-tune"), "cpu")
    with pytest.raises(FeatureCacheError, match=r"other settings \(target: .*; the target's sampled weights: "):
        _write(other, samples, out)


def test_a_rerun_on_a_complete_cache_verifies_it_and_rewrites_a_damaged_shard(tiny, samples, tmp_path):
    """A shard damaged on disk at its size (a flipped bit) is found by running the writer again on
    the complete cache, which rewrites that shard only; every feature then verifies."""
    out = tmp_path / "cache"
    _write(tiny, samples, out)
    index_file, entry = _first_entry(out)
    shard = index_file.with_suffix(".bin")
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 1000] ^= 0x01
    shard.write_bytes(bytes(data))
    damaged = len(json.loads(index_file.read_text())["samples"])
    others = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*.bin") if p != shard}
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        report = _write(tiny, samples, out, log=handle)
    text = log.read_text()
    assert "verifying the checksums of" in text
    assert f"{shard.name} is damaged (sample {entry['id']}: feature checksum mismatch); rewriting it" in text
    assert report.samples_written == damaged > 0
    assert report.samples_kept + report.samples_written == len(samples[0])
    for path, identity in others.items():
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity  # not rewritten
    cache = FeatureCache(out)
    for sample in cache.samples():
        cache.features_of(sample.sample_id)  # every checksum verifies
