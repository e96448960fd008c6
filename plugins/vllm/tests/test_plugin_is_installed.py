import importlib.metadata

from weightsync import make_plugin_manager


def test_entry_point_is_discovered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["vllm"].value == "weightsync_vllm.plugin"
    pm = make_plugin_manager()
    assert pm.get_plugin("vllm") is not None
