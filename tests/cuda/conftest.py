"""Real CUDA tests: marked `cuda` and skipped (never counted as passed) without a CUDA device."""

import pytest


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "cuda")
    have = _cuda_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not have:
                item.add_marker(skip)
