import pytest

from weightsync.plugins import load_components, make_plugin_manager


@pytest.fixture
def pm():
    """A fresh manager with built-ins and the reference engine's adapter (what the configs
    default to) only, so results do not depend on what else is installed."""
    from weightsync_reference import plugin as reference_plugin
    manager = make_plugin_manager(load_entrypoints=False)
    manager.register(reference_plugin, name="reference")
    return manager


@pytest.fixture
def components(pm):
    return load_components(pm)
