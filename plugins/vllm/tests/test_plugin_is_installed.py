import importlib.metadata
import os

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


def test_asking_whether_vllm_imports_leaves_the_environment_as_it_was() -> None:
    """Importing vLLM sets VLLM_LOGGING_LEVEL, TORCHINDUCTOR_* and more in os.environ; the
    question `vllm_available()` answers leaves none of it. Asked in a fresh process whose
    environment has none of what vLLM sets (this one may have imported vLLM already)."""
    import importlib.util
    import subprocess
    import sys

    import pytest
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(reason="vLLM is not installed")
    code = ("import os, sys, json\nbefore = dict(os.environ)\n"
            "from weightsync_vllm.launch import vllm_available\nok, why = vllm_available()\n"
            "after = dict(os.environ)\n"
            "print(json.dumps([ok, 'vllm' in sys.modules, sorted(k for k in set(before) | set(after)"
            " if before.get(k) != after.get(k))]))\n")
    vllms = ("VLLM_", "TORCHINDUCTOR_", "PYTORCH_NVML", "TRITON_", "TILELANG_", "RAY_CLIENT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(vllms)
           and not (k == "LD_LIBRARY_PATH" and "cv2" in v)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == '[true, true, []]', r.stdout
