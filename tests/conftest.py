import os
import sys

import pytest
import torch

# Triton kernels run under Triton's CPU interpreter when there is no GPU (CI); it must be set before any
# module decorates a kernel, i.e. before test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_EXIT = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's status without the interpreter's own teardown. The suite loads native libraries (Ray,
    gRPC, torch, Triton's interpreter) whose exit handlers crashed once in CI after every test had passed ("399
    passed", then a segmentation fault from `make test`), which turns a green run red. By now the summary is
    written and every other plugin has unconfigured."""
    if _EXIT in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT])
