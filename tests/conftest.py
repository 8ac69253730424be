import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model or dataset hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the unit tests on two workers, which keep both cores busy: torch on two threads in a worker,
    # or in a process a test starts, would spin against the other worker (docs/performance.md, "Sharing the
    # machine"). A stage sets its own threads from its config all the same.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files that keep a worker longest on 2 busy cores (pytest --durations=0: 40 s to nearly 3 minutes each), longest
# first. `make test` hands out files in collection order (--no-loadscope-reorder; xdist's own order puts files of
# few tests last, the lock check among them), so the two workers end close together instead of one running a long
# file alone at the end.
LONG_FILES = ("test_distributed.py", "test_locks.py", "test_gpu_check.py", "test_sft_ranks.py", "test_rl_bench_trl.py",
              "test_slurm_standin.py", "test_stage_guard.py", "test_sandbox.py")
_LONG_RANK = {name: i for i, name in enumerate(LONG_FILES)}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _LONG_RANK.get(item.path.name, len(LONG_FILES)))


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

