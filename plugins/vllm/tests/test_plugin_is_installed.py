import importlib.metadata

from weightsync import make_plugin_manager


def test_entry_point_is_discovered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["vllm"].value == "weightsync_vllm.plugin"
    pm = make_plugin_manager()
    assert pm.get_plugin("vllm") is not None


def test_vllm_general_plugin_entry_point() -> None:
    """vLLM runs `vllm.general_plugins` in each of its processes: that is how the `weightsync`
    weight-transfer backend gets registered inside the workers."""
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps["weightsync"].value == "weightsync_vllm.vllm_plugin:register"
