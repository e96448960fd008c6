import json
import subprocess
import sys


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "weightsync", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_plugins_json_lists_builtins_and_installed_plugins():
    out = run("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    core = rows["weightsync.builtin"]
    assert core["distribution"] == "weightsync-core" and core["version"] == "0.1.0"
    assert {"transport:http", "encoding:raw", "encoding:cast", "exporter:torch",
            "adapter:reference"} <= set(core["components"])
    for ep in ("sglang", "vllm", "lmdeploy", "disk_delta"):
        assert ep in rows and rows[ep]["distribution"].startswith("weightsync-")


def test_plugins_table():
    out = run("plugins")
    assert out.returncode == 0 and "weightsync-core" in out.stdout


def test_check_accepts_and_refuses(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("transport: http\nengines: [{url: 'http://127.0.0.1:9'}]\n")
    out = run("check", str(good))
    assert out.returncode == 0 and "transport http" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("transport: teleport\nengines: [{url: 'http://127.0.0.1:9'}]\n")
    out = run("check", str(bad))
    assert out.returncode == 2 and "unknown transport 'teleport'" in out.stderr


def test_demo_main_job(tmp_path):
    """The README's main job: train, push each step into a separate engine process, compare
    greedy generation; exit 0 only if every sync verified and generations are identical."""
    out = run("demo", "--steps", "2", "--workdir", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == 2 and all("verified True" in ln for ln in steps)
    assert "version 2" in steps[1] and any("IDENTICAL" in ln for ln in lines)
