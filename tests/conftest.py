import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model or dataset hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def cfg_factory(tmp_path):
    """Compose the config with overrides, writing runs under a temporary folder."""
    from recipe.config import load_config

    def make(*overrides):
        return load_config([f"run_root={tmp_path / 'runs'}", *overrides])

    return make


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: a tiny model runs fastest so, two threads spin against each other on a
    busy 2-core machine. Modules that want it everywhere use it with pytest.mark.usefixtures."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

