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


def test_the_plugin_registers_its_launcher_and_sampler() -> None:
    """The launcher through core's hook; the sampler through RL's (optional) hook, where RL is
    installed: the plugin itself never imports weightsync_rl."""
    import pytest
    from weightsync.plugins import load_components
    from weightsync_vllm.adapter import VllmAdapter
    from weightsync_vllm.generation import VllmSampler
    from weightsync_vllm.launch import VllmLauncher
    components = load_components()
    assert components.launchers.get("vllm") is VllmLauncher
    assert components.adapters.get("vllm") is VllmAdapter
    rl = pytest.importorskip("weightsync_rl.rollout.sampler")
    assert rl.samplers(components)["vllm"] is VllmSampler
    sampler = rl.sampler_for(VllmAdapter(), components)
    assert isinstance(sampler, VllmSampler) and isinstance(sampler, rl.Sampler)
