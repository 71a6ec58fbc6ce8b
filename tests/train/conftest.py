"""Fixtures shared by the trainer tests that build an Engine in the test process."""

import pytest
import torch.distributed as dist

from hpcrl.train.dist import init_distributed


@pytest.fixture(scope="module")
def dist_info():
    """A one-rank process group for the module's engines; destroyed after it unless one was there already."""
    created = not dist.is_initialized()
    info = init_distributed()
    yield info
    if created:
        dist.destroy_process_group()
