"""pytest set-up, no test logic. The default run is the fast suite (a few minutes on 2 cores): every
reference in test_losses.py, the model against transformers, the data, the loop in process. `--slow`
adds the long end-to-end tests, marked `@pytest.mark.slow` where they are written (full runs in
subprocesses, DDP on gloo, signals and kills, reproduce.py); CI always passes it. A test named on
the command line (`pytest test_train.py::test_x`) runs whether it is slow or not.

The tests run in one worker process a core (pytest-xdist, at most 8), each with one thread, a file's tests in
one worker (its module fixtures made once): on 2 cores the fast suite took 155-187 s against 267 s in one
process. `-n N` runs them in N workers, `-n 0` in this process, as do `-s`, `--pdb` and `--trace` (a worker
hides output and debuggers), one file, or a test named with `::` (test_cuda.py on a GPU machine, a -k selection)."""
import os

import pytest

MAX_WORKERS = 8  # each worker imports torch and transformers: ~1 GB apiece


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the long end-to-end tests (marked slow; CI runs them)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads -n
def pytest_cmdline_main(config):
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return  # (a worker: xdist runs this hook there too, with -n unset)
    one_file = len(config.args) == 1 and config.args[0].endswith(".py")  # one worker would run it all (loadfile)
    here = config.getoption("usepdb") or config.getoption("trace") or config.getoption("capture") == "no"  # -s
    if config.option.numprocesses is None and not here and not one_file and not any("::" in a for a in config.args):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cores > 1:  # xdist's count (PYTEST_XDIST_AUTO_NUM_WORKERS where set), at most MAX_WORKERS
            config.option.numprocesses, config.option.maxprocesses = "auto", config.option.maxprocesses or MAX_WORKERS
    if config.option.numprocesses:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers inherit it: 2 workers x 2 threads each ran slower
        if config.option.dist == "no":
            # a module's tests in one worker, its module fixtures made once: test_device_run.py's trains all four
            # chunks (200 s), test_cuda.py's starts every run of its end-to-end tests (xdist's default splits a module)
            config.option.dist = "loadfile"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end test, run only with --slow")
    # torch's own, at the compiler's import (torch.utils.mkldnn): nothing a test here can change
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or any("::" in arg for arg in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
