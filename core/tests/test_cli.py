import json
import os
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
    import weightsync
    assert core["distribution"] == "weightsync-core" and core["version"] == weightsync.__version__
    assert {"transport:http", "encoding:raw", "encoding:cast", "exporter:torch"} \
        <= set(core["components"])
    assert "adapter:reference" in rows["reference"]["components"]
    for ep in ("sglang", "vllm", "lmdeploy", "disk_delta", "reference", "bench", "ray", "rl"):
        assert ep in rows and rows[ep]["distribution"].startswith("weightsync-")


def test_plugins_table():
    out = run("plugins")
    assert out.returncode == 0 and "weightsync-core" in out.stdout


def test_check_accepts_and_refuses(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("transport: http\nengines: [{url: 'http://127.0.0.1:9'}]\n")
    out = run("check", "--offline", str(good))          # the config alone: nothing contacted
    assert out.returncode == 0 and "transport http" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("transport: teleport\nengines: [{url: 'http://127.0.0.1:9'}]\n")
    out = run("check", str(bad))
    assert out.returncode == 2 and "unknown transport 'teleport'" in out.stderr


# -- a plain install's first hour: fast help, versions, one-line errors ------------------------
def test_help_and_version_do_not_import_torch():
    code = ("import sys; from weightsync.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported for --help'\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "weightsync-core 0.2.0" in out.stdout and "weightsync-vllm" in out.stdout


def test_every_option_has_help_with_its_default():
    from weightsync.cli import parser
    p = parser()
    subs = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"][0]
    pending = list(subs.choices.items())
    while pending:
        name, sp = pending.pop()
        for a in sp._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                pending += [(f"{name} {n}", c) for n, c in a.choices.items()]
                continue
            if a.dest in ("help",):
                continue
            assert a.help, f"weightsync {name} {a.option_strings or a.dest} has no help text"
        options = [a for a in sp._actions if a.option_strings and a.dest != "help"
                   and a.__class__.__name__ != "_SubParsersAction"]
        if options:
            assert "(default:" in sp.format_help(), name


def test_user_errors_are_one_line_and_exit_2(tmp_path):
    import socket
    out = run("serve", "--model", str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.startswith("error: model directory") \
        and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    from weightsync.testing import sample_state_dict, write_weights_only_model
    model = write_weights_only_model(tmp_path / "m", sample_state_dict())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run("serve", "--model", str(model), "--port", str(port))
    assert out.returncode == 2 and f"port {port} is already in use" in out.stderr
    assert "Traceback" not in out.stderr
    out = run("check", str(tmp_path))
    assert out.returncode == 2 and "is a directory" in out.stderr and "Traceback" not in out.stderr
    bad = tmp_path / "broken.yaml"
    bad.write_text("transport: http\nengines: [{url: 'http://x:1'\n")
    out = run("check", str(bad))
    assert out.returncode == 2 and "broken.yaml" in out.stderr and "<unicode string>" not in out.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("engines: []\n")
    out = run("check", str(empty))
    assert out.returncode == 2 and "lists no engines" in out.stderr


def test_check_reports_every_problem_at_once(tmp_path):
    cfg = tmp_path / "many.yaml"
    cfg.write_text("transport: teleport\nencoding: {kind: cast, options: {dtype: int3}}\n"
                   "engines: [{url: 'http://127.0.0.1:9', adapter: nope}, {url: 'http://127.0.0.1:9'}]\n")
    out = run("check", str(cfg))
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 2 and len(errors) >= 2, out.stderr
    assert any("unknown transport 'teleport'" in e for e in errors)
    assert any("encoding 'cast': bad options" in e for e in errors)


def test_check_says_where_a_key_belongs_and_what_a_name_was_meant_to_be(tmp_path):
    """One pass: the schema's problems (a misplaced key, a misspelt one) and an unknown
    component's name, each with the fix."""
    cfg = tmp_path / "typos.yaml"
    cfg.write_text("transport: htpp\npause_mode: keep\nsync: {lease: 5, probe: {lenght: 8}}\n"
                   "engines: [{url: 'http://127.0.0.1:9', token: abc}]\n")
    out = run("check", str(cfg))
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 2 and sorted(errors) == sorted([
        "error: pause_mode: unknown key; `pause_mode` belongs under `sync`",
        "error: sync.probe.lenght: unknown key; did you mean `length`?",
        "error: engines.0.token: unknown key; an engine takes ['adapter', 'api_key', 'name', "
        "'options', 'url', 'verify']; an adapter option such as `token` goes under that engine's "
        "`options` (or the top-level `adapter.options`)",
        "error: unknown transport 'htpp'; did you mean 'http'?; installed: "
        + str(sorted(__import__("weightsync.plugins").plugins.load_components().transports.names())),
    ]), out.stderr


def test_serve_makes_openmp_threads_wait_passively_unless_told():
    """Engine processes share a host's cores: `serve` makes torch's OpenMP threads wait
    passively (set before torch loads), unless the user chose a policy."""
    code = ("import os, sys; from weightsync.cli import main\n"
            "main(['serve', '--model', '/nonexistent-model-dir'])\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.stdout.split() == ["PASSIVE", "False"], out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert out.stdout.split() == ["ACTIVE", "False"], out.stdout + out.stderr
