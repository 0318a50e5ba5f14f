"""The run folder's rows.cache: rendered rows read back only when nothing they depend on changed."""

import gzip
import shutil
import warnings

import pytest
import torch
from data_files import REGENERATED_64
from transformers import AutoTokenizer

from dflash_train.data.rows_cache import CACHE_NAME, cached_training_samples
from dflash_train.data.samples import load_training_samples

SETTINGS = dict(max_length=768, min_supervised_tokens=32)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def start(folder, data, tokenizer, **settings):
    """What a run's start does: the rows (read back or rendered), kept for the next start."""
    rendering = cached_training_samples(folder, data, tokenizer, **(settings or SETTINGS))
    rendering.keep(folder)
    return rendering


def same_rows(got, want) -> bool:
    return len(got) == len(want) and all(
        g.sample_id == w.sample_id and g.source == w.source and g.input_ids.dtype == torch.long
        and torch.equal(g.input_ids, w.input_ids) and torch.equal(g.loss_mask, w.loss_mask)
        for g, w in zip(got, want))


def test_rows_are_read_back_as_rendered_and_rendered_again_when_the_data_or_settings_change(tmp_path, tokenizer):
    data = tmp_path / "data.jsonl"
    data.write_bytes(gzip.open(REGENERATED_64).read())
    run = tmp_path / "run"
    run.mkdir()
    rendered, stats = load_training_samples([data], tokenizer, **SETTINGS)

    unkept = cached_training_samples(run, [data], tokenizer, **SETTINGS)
    assert not unkept.read_back and not (run / CACHE_NAME).exists()  # nothing written until the run keeps it
    first = start(run, [data], tokenizer)
    assert not first.read_back and same_rows(first.rows, rendered) and (run / CACHE_NAME).is_file()
    again = start(run, [data], tokenizer)
    assert again.read_back and same_rows(again.rows, rendered)
    assert again.stats.summary() == first.stats.summary() == stats.summary() and again.stats.used == len(again.rows)

    # Another setting, then other bytes in the data file: rendered afresh, and the file follows.
    longer = start(run, [data], tokenizer, max_length=768, min_supervised_tokens=8)
    assert not longer.read_back and len(longer.rows) > len(rendered)
    assert not start(run, [data], tokenizer).read_back  # the file held the other rendering
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:40]))
    fewer = start(run, [data], tokenizer)
    assert not fewer.read_back and same_rows(fewer.rows, load_training_samples([data], tokenizer, **SETTINGS)[0])
    assert start(run, [data], tokenizer).read_back


def test_a_damaged_cache_is_rendered_again_with_a_warning_and_replaced(tmp_path, tokenizer):
    data = tmp_path / "data.jsonl.gz"
    shutil.copy(REGENERATED_64, data)
    start(tmp_path, [data], tokenizer)
    cache = tmp_path / CACHE_NAME
    cache.write_bytes(cache.read_bytes()[:1000])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = start(tmp_path, [data], tokenizer)
    assert not again.read_back and same_rows(again.rows, load_training_samples([data], tokenizer, **SETTINGS)[0])
    assert any("could not be read back" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert start(tmp_path, [data], tokenizer).read_back
