"""Shared by every test module: commands run in-process configure the root logger; each test starts clean."""
import logging
import os
import subprocess
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when it defines a function (its own library's included), and importing timm imports
# it: set here, before any test module imports timm, so that without a GPU test_kernels.py runs the Triton kernels
# on the CPU under the interpreter
if not os.path.exists('/dev/nvidiactl'):
    os.environ.setdefault('TRITON_INTERPRET', '1')

# OpenMP's idle threads sleep instead of spinning (set before torch loads libgomp; child processes inherit it): with
# the default, each idle pool (torch's and MKL's) spins for the CPU while the machine runs other work, and on a
# 2-core machine shared with one other process, tests of small float64 ops took minutes instead of a second
# (test_models' update-factor cases: over 600 s against 12 s for six models)
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

# under pytest-xdist (`make test` runs `-n auto`) each worker gets its share of the cores: N workers of torch's
# default (a thread for every core) would contend for them
if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    os.environ.setdefault('OMP_NUM_THREADS', str(max(1, cores // int(os.environ['PYTEST_XDIST_WORKER_COUNT']))))

import pytest


@pytest.fixture(autouse=True)
def _restore_root_logger():
    """Remove the handlers a test added to the root logger: bound to that test's captured streams, which pytest
    closes afterwards, they would fail every later log call (`--- Logging error ---`)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


SCRIPTS = Path(__file__).parents[1] / 'scripts'


@pytest.fixture
def run_script():
    """Run `python scripts/<name>.py ARGS...` (the developer scripts of the source tree) as `__main__` in this process
    (examples.py's runner: the scripts' folder first on sys.path, the process state a script sets restored
    afterwards), returning it as a finished process (exit status, text output). With subprocess.run's keyword
    arguments (`env=`), in a fresh process. A fresh interpreter imports torch and timm again, which took longer than
    most of these runs; test_scripts.py starts every script in a fresh one."""
    def run(name: str, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(SCRIPTS / f'{name}.py'), *args]
        if kwargs:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
        from examples import _in_process
        outcome = _in_process(['python', f'scripts/{name}.py', *args])
        return subprocess.CompletedProcess(argv, outcome.status, outcome.out, outcome.err)
    return run
