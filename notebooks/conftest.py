"""The lessons under pytest-xdist: a lesson's cells share one kernel and run in order, so each lesson goes to
one worker whole (``--dist loadgroup``), while the tests, one at a time, go wherever a worker is free."""

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups from the markers
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(item.path.name))
