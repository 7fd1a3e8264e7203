"""Fixtures of the launcher tests that move this process between cores (test_borrow.py, test_engine_borrow.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from agentrl.launcher.cores import pin_to_cores


@pytest.fixture
def restore_cores() -> Iterator[None]:
    """Put this process's cores and torch threads back after a test that changed them."""
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    yield
    pin_to_cores(cores)
    torch.set_num_threads(threads)
