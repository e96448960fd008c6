import importlib.metadata

from weightsync import make_plugin_manager


def test_entry_point_is_discovered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["disk_delta"].value == "weightsync_disk_delta.plugin"
    pm = make_plugin_manager()
    assert pm.get_plugin("disk_delta") is not None
