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

    first, first_stats, read_back = cached_training_samples(run, [data], tokenizer, write=True, **SETTINGS)
    assert not read_back and same_rows(first, rendered) and (run / CACHE_NAME).is_file()
    again, again_stats, read_back = cached_training_samples(run, [data], tokenizer, write=True, **SETTINGS)
    assert read_back and same_rows(again, rendered)
    assert again_stats.summary() == first_stats.summary() == stats.summary() and again_stats.used == len(again)

    # Another setting, then other bytes in the data file: rendered afresh, and the file follows.
    longer, _, read_back = cached_training_samples(run, [data], tokenizer, write=True, max_length=768,
                                                   min_supervised_tokens=8)
    assert not read_back and len(longer) > len(rendered)
    assert not cached_training_samples(run, [data], tokenizer, write=True, **SETTINGS)[2]  # the file holds the other one now
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:40]))
    fewer, _, read_back = cached_training_samples(run, [data], tokenizer, write=True, **SETTINGS)
    assert not read_back and same_rows(fewer, load_training_samples([data], tokenizer, **SETTINGS)[0])
    assert cached_training_samples(run, [data], tokenizer, write=True, **SETTINGS)[2]


def test_a_damaged_cache_is_rendered_again_with_a_warning_and_replaced(tmp_path, tokenizer):
    data = tmp_path / "data.jsonl.gz"
    shutil.copy(REGENERATED_64, data)
    cached_training_samples(tmp_path, [data], tokenizer, write=True, **SETTINGS)
    cache = tmp_path / CACHE_NAME
    cache.write_bytes(cache.read_bytes()[:1000])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _, read_back = cached_training_samples(tmp_path, [data], tokenizer, write=True, **SETTINGS)
    assert not read_back and same_rows(rows, load_training_samples([data], tokenizer, **SETTINGS)[0])
    assert any("could not be read back" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert cached_training_samples(tmp_path, [data], tokenizer, write=True, **SETTINGS)[2]


def test_a_process_that_does_not_own_the_run_folder_writes_nothing_there(tmp_path, tokenizer):
    rows, _, read_back = cached_training_samples(tmp_path, [REGENERATED_64], tokenizer, write=False, **SETTINGS)
    assert rows and not read_back and not (tmp_path / CACHE_NAME).exists()
