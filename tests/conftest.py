import os
import sys

import pytest
import torch

# Triton kernels run under Triton's CPU interpreter when there is no GPU (CI); it must be set before any
# module decorates a kernel, i.e. before test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_EXIT = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def tiny_parse(tmp_path_factory):
    """A PARSE (svd-llm, keep 0.6) checkpoint of the bundled model, built in seconds: routers trained just enough
    to route, not to help (the evaluation tests need a real one, not a good one)."""
    from pathlib import Path

    from rankserve.compress.parse import TrainConfig, build_parse_checkpoint
    root = Path(__file__).resolve().parents[1]
    calib = root / "tests" / "data" / "tinyshakespeare-head.txt"
    return build_parse_checkpoint(root / "models" / "stories260K", tmp_path_factory.mktemp("tiny-parse") / "parse",
                                  keep=0.6, calib_text=calib, train_text=calib, steps=2, kd_steps=0,
                                  calib_tokens=2048, calib_seq_len=128,
                                  train=TrainConfig(windows=32, window=32, prompt_len=16, batch_size=16,
                                                    collect_batch=16), progress=False)


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
