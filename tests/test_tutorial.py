"""docs/writing-plugins.md, followed as a reader would: every `$` command of its console blocks,
in order, in a fresh virtual environment (torch linked in, see conftest.py), from a directory
holding the tutorial's files. Each command must succeed and print what the page shows (timings
and other decimals may differ). core/tests/test_docs.py checks the files and outputs in detail.

What differs from a reader's machine, and why:
- `git clone https://github.com/weightsync/weightsync` clones a local repository holding this
  working tree (the project's URL is not reachable from CI, and must serve this tree anyway);
- the engine's port 8100 and the payload directory /tmp/weightsync-echo are replaced by a free
  port and a temporary directory, in the commands, in echo-sync.yaml and in expected output, so
  that parallel runs do not collide;
- `my-model`, which the page leaves to the reader ("any Hugging Face checkpoint or just its
  weights"), is a small weights-only checkpoint;
- `weightsync serve` runs in the background until the end, as in a second terminal."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from weightsync.testing import sample_state_dict, write_weights_only_model

from weightsync.net.server import free_port

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "writing-plugins.md"
EXAMPLES = ROOT / "docs" / "examples"
PROJECT_URL = "https://github.com/weightsync/weightsync"


def console_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines the page shows under it) for every `$` line of every
    ```console block, in page order."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:].strip(), []))
            elif out and line.strip():
                out[-1][1].append(line)
    return out


def normal(line: str) -> str:
    """A line with decimals (timings, sizes) and runs of spaces made uniform."""
    return re.sub(r"\s+", " ", re.sub(r"\d+\.\d+", "#", line)).strip()


def shows(expected: list[str], actual: str) -> bool:
    """The expected lines appear in the output in that order (other lines may come between)."""
    lines = iter(normal(x) for x in actual.splitlines())
    return all(any(normal(e) == a for a in lines) for e in expected)


@pytest.mark.slow
def test_every_shell_command_of_the_tutorial_in_a_fresh_venv(fresh_env, git_mirror: Path,
                                                              scratch) -> None:
    tmp_path = scratch("tutorial")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(EXAMPLES / "weightsync-echo", work / "weightsync-echo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
    shutil.copy(EXAMPLES / "push_echo.py", work / "push_echo.py")
    port, payloads = str(free_port()), str(tmp_path / "echo-payloads")
    swaps = {PROJECT_URL: f"file://{git_mirror}", "8100": port, "/tmp/weightsync-echo": payloads}

    def swap(s: str) -> str:
        for a, b in swaps.items():
            s = s.replace(a, b)
        return s

    config = (EXAMPLES / "echo-sync.yaml").read_text()
    assert "8100" in config and "/tmp/weightsync-echo" in config
    (work / "echo-sync.yaml").write_text(swap(config))
    write_weights_only_model(work / "my-model", sample_state_dict())

    commands = console_commands(TUTORIAL.read_text())
    assert len(commands) >= 8, commands
    assert [c for c, _ in commands[:2]] == [f"git clone {PROJECT_URL}",
                                            "pip install './weightsync/core[testing]' "
                                            "'./weightsync/plugins/reference[testing]'"], \
        "the page starts by installing core and the reference engine"
    env = fresh_env("tutorial", with_pip=True)
    server = None
    try:
        for command, expected in commands:
            command, expected = swap(command), [swap(e) for e in expected]
            if command.startswith("weightsync serve "):
                server, output = start_server(env, command, work, port)
            else:
                r = env.run(command, cwd=work, timeout=600, merge=True)
                output = r.stdout
                if command.startswith("pip "):
                    env.check_pip(r, command)     # skips when the package index is unreachable
                assert r.returncode == 0, f"`{command}` failed (exit {r.returncode}):\n{output[-6000:]}"
            assert shows(expected, output), (f"`{command}` did not print what the page shows:\n"
                                             f"page:\n" + "\n".join(expected) + f"\ngot:\n{output[-4000:]}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def start_server(env, command: str, work: Path, port: str) -> tuple[subprocess.Popen, str]:
    """The page's `weightsync serve` in the background; returns once it answers /health."""
    log = work / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=work, stdout=f,
                                stderr=subprocess.STDOUT, env=env.env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"`{command}` exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, log.read_text()
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"`{command}` did not answer /health in 120 s:\n{log.read_text()[-4000:]}")
