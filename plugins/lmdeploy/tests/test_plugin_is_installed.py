import importlib.metadata

from weightsync import make_plugin_manager


def test_entry_point_is_discovered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["lmdeploy"].value == "weightsync_lmdeploy.plugin"
    pm = make_plugin_manager()
    assert pm.get_plugin("lmdeploy") is not None


def test_sampler_is_registered_through_rls_hook():
    import pytest
    rl = pytest.importorskip("weightsync_rl.rollout.sampler",
                             reason="weightsync-rl is not installed; the sampler hook is RL's")
    from weightsync import load_components
    from weightsync_lmdeploy.adapter import LmdeployAdapter
    from weightsync_lmdeploy.generation import LmdeploySampler
    components = load_components()
    assert rl.samplers(components)["lmdeploy"] is LmdeploySampler
    sampler = rl.sampler_for(LmdeployAdapter(), components)
    assert isinstance(sampler, rl.Sampler) and isinstance(sampler, LmdeploySampler)
    assert sampler.gates is False and sampler.busy_seconds() is None
