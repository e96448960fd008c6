import pytest

from weightsync.plugins import load_components, make_plugin_manager


@pytest.fixture
def pm():
    """A fresh manager with built-ins only, so results do not depend on what is installed."""
    return make_plugin_manager(load_entrypoints=False)


@pytest.fixture
def components(pm):
    return load_components(pm)
