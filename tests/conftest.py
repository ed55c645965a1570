import pytest
import torch


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
