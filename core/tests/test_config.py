import json
from typing import Protocol, runtime_checkable

import pytest

from weightsync import ConfigError, PluginError, WeightSync
from weightsync.sync.assembly import resolve
from weightsync.config import SyncConfig, parse_bytes
from weightsync.interfaces import Transport


def test_loads_yaml_toml_json_and_dict(tmp_path, components):
    data = {"transport": "http", "adapter": {"kind": "reference", "options": {"timeout": 5}},
            "engines": [{"url": "http://127.0.0.1:9001", "name": "a"}],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": "8MiB"}}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(
        "transport: http\nadapter: {kind: reference, options: {timeout: 5}}\n"
        "engines: [{url: 'http://127.0.0.1:9001', name: a}]\n"
        "exporter: {kind: torch, options: {bucket_bytes: 8MiB}}\n")
    (tmp_path / "c.toml").write_text(
        'transport = "http"\n[adapter]\nkind = "reference"\noptions = {timeout = 5}\n'
        '[[engines]]\nurl = "http://127.0.0.1:9001"\nname = "a"\n'
        '[exporter]\nkind = "torch"\noptions = {bucket_bytes = "8MiB"}\n')
    for src in (data, tmp_path / "c.json", tmp_path / "c.yaml", tmp_path / "c.toml"):
        r = resolve(SyncConfig.load(src), components)
        assert r.transport_cls.name == "http" and r.engines[0].adapter_options.timeout == 5
        assert r.exporter_options.bucket_bytes == 8 * 2**20
        assert r.engines[0].spec.name == "a"


def test_engine_name_defaults_to_host_port():
    cfg = SyncConfig.load({"engines": [{"url": "http://10.0.0.5:30000"}]})
    assert cfg.engines[0].name == "10.0.0.5:30000"


def test_unknown_component_lists_installed(components):
    with pytest.raises(PluginError) as e:
        resolve(SyncConfig.load({"transport": "rdma", "engines": []}), components)
    assert "unknown transport 'rdma'" in str(e.value) and "'http'" in str(e.value)


def test_wrong_option_names_component_and_allowed(components):
    with pytest.raises(ConfigError) as e:
        resolve(SyncConfig.load({"transport": {"kind": "http", "options": {"timout": 3}},
                                 "engines": []}), components)
    msg = str(e.value)
    assert "transport 'http'" in msg and "timout: unknown option; did you mean `timeout`?" in msg
    assert "known keys here" not in msg             # the config's top-level keys are no hint here


def test_bad_option_value(components):
    with pytest.raises(ConfigError, match="bucket_bytes"):
        resolve(SyncConfig.load({"exporter": {"kind": "torch", "options": {"bucket_bytes": "lots"}}}),
                components)


def test_unknown_top_level_key_and_bad_url():
    with pytest.raises(ConfigError, match="engine"):
        SyncConfig.load({"engine": []})
    with pytest.raises(ConfigError, match="http://host:port"):
        SyncConfig.load({"engines": [{"url": "localhost:8000"}]})


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SyncConfig.load(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("engines: [unclosed")
    with pytest.raises(ConfigError, match="could not be parsed"):
        SyncConfig.load(tmp_path / "bad.yaml")
    (tmp_path / "c.ini").write_text("x=1")
    with pytest.raises(ConfigError, match=".yaml, .yml, .toml or .json"):
        SyncConfig.load(tmp_path / "c.ini")


def test_impossible_combination_says_what_works(pm, components):
    class PigeonLoft(Protocol):
        def loft(self) -> str: ...

    class CarrierPigeon(Transport):
        name = "pigeon"
        requires = (runtime_checkable(PigeonLoft),)

        def send(self, payload, engines):
            return {}

    components.transports.add(CarrierPigeon)
    with pytest.raises(ConfigError) as e:
        resolve(SyncConfig.load({"transport": "pigeon", "engines": [{"url": "http://127.0.0.1:1"}]}),
                components)
    msg = str(e.value)
    assert "cannot receive over transport 'pigeon'" in msg and "'http'" in msg
    assert "it lacks capability PigeonLoft" in msg, msg


def test_a_transport_message_the_adapter_cannot_deliver_is_refused(components):
    """An adapter with its own routes lists the messages it translates; a transport that sends
    another is refused at config load, naming the message."""
    from weightsync.interfaces import Announce, Message
    from weightsync_reference.adapter import ReferenceAdapter

    class Ping(Message):
        kind = "pigeon.ping"

    class Narrow(ReferenceAdapter):
        name = "narrow"
        accepts = (Announce,)

    class Pinger(Transport):
        name = "pinger"
        messages = (Announce, Ping)

        def send(self, payload, engines):
            return {}

    components.adapters.add(Narrow)
    components.transports.add(Pinger)
    cfg = {"adapter": "narrow", "transport": "pinger", "engines": [{"url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match=r"it lacks message Ping \('pigeon.ping'\)"):
        resolve(SyncConfig.load(cfg), components)
    resolve(SyncConfig.load({**cfg, "adapter": "reference"}), components)   # accepts any


def test_unsupported_pause_mode(components):
    with pytest.raises(ConfigError, match="pause_mode 'retract'.*'abort', 'keep'"):
        resolve(SyncConfig.load({"engines": [{"url": "http://127.0.0.1:1"}],
                                 "sync": {"pause_mode": "retract"}}), components)


def test_duplicate_engine_names(components):
    with pytest.raises(ConfigError, match="two engines are named 'x'"):
        resolve(SyncConfig.load({"engines": [{"url": "http://127.0.0.1:1", "name": "x"},
                                             {"url": "http://127.0.0.1:2", "name": "x"}]}), components)


def test_from_config_refuses_before_any_network(components):
    with pytest.raises(PluginError):
        WeightSync.from_config({"adapter": "sglangg", "engines": [{"url": "http://127.0.0.1:1"}]},
                               components=components)


@pytest.mark.parametrize("text,value", [("64MiB", 64 * 2**20), ("1 GiB", 2**30), (4096, 4096),
                                        ("10mb", 10**7), ("1.5KiB", 1536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value
