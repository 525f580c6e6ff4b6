"""pytest set-up, no test logic. The default run is the fast suite (a few minutes on 2 cores): every
reference in test_losses.py, the model against transformers, the data, the loop in process. `--slow`
adds the long end-to-end tests, marked `@pytest.mark.slow` where they are written (full runs in
subprocesses, DDP on gloo, signals and kills, reproduce.py); CI always passes it. A test named on
the command line (`pytest test_train.py::test_x`) runs whether it is slow or not."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the long end-to-end tests (marked slow; CI runs them)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end test, run only with --slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or any("::" in arg for arg in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
