from pathlib import Path

import pytest
import torch


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    # A run of the GPU suite alone (`pytest -m gpu`, as on the device image, which lacks the CPU-only test extras
    # such as datasets) skips importing the files that hold no GPU test; any other run collects every file, so a
    # missing extra there is a collection error, not a skip.
    if config.getoption("markexpr") != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.gpu" not in collection_path.read_text()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _tokenized_cache_in_a_temporary_folder(tmp_path_factory):
    # tests must not read (or fill) the user's cache of tokenized sets: a stale entry would hide a change
    mp = pytest.MonkeyPatch()
    mp.setenv("LAZYTRAIN_CACHE", str(tmp_path_factory.mktemp("lazytrain-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def bf16_mixed_two_procs(tmp_path_factory):
    """One 2-process run of ``dist_driver.py`` with `BF16_MIXED_ARGS` and a checkpoint each step, its model built in
    ``__init__``, made once for the two files that read it: test_distributed, test_distributed_node_load."""
    from dist_launch import BF16_MIXED_ARGS, launch  # the distributed tests' helper, imported only when used

    out = tmp_path_factory.mktemp("bf16_mixed_two_procs")
    return launch(out, *BF16_MIXED_ARGS, "--ckpt-dir", str(out / "ckpt"))
