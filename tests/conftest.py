"""Shared by every test module: commands run in-process configure the root logger; each test starts clean."""
import logging

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
