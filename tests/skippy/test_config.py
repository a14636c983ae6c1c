"""The one config reader: environment and node TOML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skippy.config import load_node_config, parse_artifact_transfer, read_environment
from skippy.errors import InputUnreadable, UsageError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, True),
        ("", True),
        ("1", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("FALSE", False),
        ("off", False),
    ],
)
def test_local_sha_verification_is_on_unless_disabled(value, expected):
    env = {} if value is None else {"SKIPPY_VERIFY_PACKAGE_SHA": value}
    assert read_environment(env).verify_local_sha256 is expected


OPEN_WORDS = ("open", "1", "true", "on", "yes", "any", "public")
TRUSTED_WORDS = ("trusted", "trust", "owner", "owners", "same-owner", "allowlist")


@pytest.mark.parametrize(
    ("value", "mode"),
    [(w, "open") for w in OPEN_WORDS]
    + [(w, "trusted") for w in TRUSTED_WORDS]
    + [(" OPEN ", "open"), ("Same-Owner", "trusted"), ("\ttrusted\n", "trusted")]
    + [(w, "disabled") for w in ("", "  ", "disabled", "off", "0", "false", "no")],
)
def test_artifact_transfer_words_follow_the_spec_table(value, mode):
    env = read_environment({"MESH_LLM_ARTIFACT_TRANSFER": value})
    assert env.artifact_transfer == mode
    assert env.warnings == ()


def test_unset_artifact_transfer_is_left_to_the_config_file():
    assert read_environment({}).artifact_transfer is None


@pytest.mark.parametrize("value", ["everyone", "trusted-ish", "opened", "2"])
def test_unknown_artifact_transfer_word_is_disabled_with_one_warning(value):
    env = read_environment({"MESH_LLM_ARTIFACT_TRANSFER": value})
    assert env.artifact_transfer == "disabled"
    assert len(env.warnings) == 1
    assert value in env.warnings[0] and "MESH_LLM_ARTIFACT_TRANSFER" in env.warnings[0]


def test_parse_artifact_transfer_names_its_source():
    mode, warning = parse_artifact_transfer("bogus", "artifact_transfer")
    assert mode == "disabled" and warning is not None and warning.startswith("artifact_transfer=")


def test_hf_cache_and_offline():
    env = read_environment({"HF_HOME": "/h", "HF_HUB_OFFLINE": "1", "HOME": "/home/u"})
    assert env.hf_cache_dir == Path("/h/hub") and env.hf_offline
    assert env.skippy_cache_dir == Path("/home/u/.cache/skippy")
    assert read_environment({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}).hf_cache_dir == Path("/c")


def test_node_toml(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[speculative]\nstrategy = "disabled"\n')
    node = load_node_config(cfg)
    assert node.speculative.global_settings.strategy == "disabled"
    assert load_node_config(None).speculative.global_settings.strategy is None


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[speculative\n")
    with pytest.raises(UsageError) as exc:
        load_node_config(bad)
    assert exc.value.code == "invalid_config"
    with pytest.raises(InputUnreadable):
        load_node_config(tmp_path / "none.toml")


def test_hub_cache_follows_huggingface_precedence():
    assert read_environment({"HOME": "/u"}).hf_cache_dir == Path("/u/.cache/huggingface/hub")
    assert read_environment({"XDG_CACHE_HOME": "/x"}).hf_cache_dir == Path("/x/huggingface/hub")
    assert read_environment({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}).hf_cache_dir == Path(
        "/h/hub"
    )


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_follows_huggingface_hub(name):
    assert read_environment({name: "1"}).hf_offline
    assert not read_environment({name: "0"}).hf_offline


def test_legacy_hub_cache_variable():
    env = read_environment({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"})
    assert env.hf_cache_dir == Path("/legacy")


# --- the mesh node's keys ------------------------------------------------------------------------
def _node_toml(tmp_path, text):
    cfg = tmp_path / "conf" / "node.toml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(text)
    return cfg


def test_node_settings_resolve_paths_against_the_config_file(tmp_path):
    from mesh_node.settings import PeerAddress, load_node_settings

    nid = "ab" * 32
    cfg = _node_toml(
        tmp_path,
        f'listen = "0.0.0.0:7000"\nidentity = "keys/node.key"\ncertificate = "keys/node.cert"\n'
        f'data_dir = "data"\npeers = ["ws://127.0.0.1:7001#{nid}", "ws://[::1]:7002"]\n'
        f'trusted_owners = ["{nid}"]\nartifact_transfer = "trusted"\nmemory_budget = "8GiB"\n'
        "heartbeat_interval_s = 1\npeer_loss_timeout_s = 5\n[speculative]\n"
        'strategy = "disabled"\n',
    )
    s = load_node_settings(cfg, read_environment({}))
    assert s.identity_path == tmp_path / "conf" / "keys" / "node.key"
    assert s.certificate_path == tmp_path / "conf" / "keys" / "node.cert"
    assert s.data_dir == tmp_path / "conf" / "data" and s.hub_cache_dir == s.data_dir / "hub"
    assert (s.listen.host, s.listen.port) == ("0.0.0.0", 7000)
    assert s.peers == (PeerAddress("127.0.0.1", 7001, nid), PeerAddress("::1", 7002, None))
    assert s.peers[1].url == "ws://[::1]:7002"
    assert s.trusted_owners == (nid,) and s.artifact_transfer == "trusted"
    assert s.memory_budget_bytes == 8 * 2**30
    assert (s.heartbeat_interval_s, s.peer_loss_timeout_s) == (1.0, 5.0)
    assert s.http is None and s.http_public is False  # no page unless asked for


def test_http_keys(tmp_path):
    from mesh_node.settings import HostPort, load_node_settings

    cfg = _node_toml(tmp_path, 'identity = "k"\nhttp = "[::1]:8080"\nhttp_public = true\n')
    s = load_node_settings(cfg, read_environment({}))
    assert s.http == HostPort("::1", 8080) and s.http_public is True
    for value in ("8081", 8081):  # a bare port is loopback
        cfg = _node_toml(tmp_path, f'identity = "k"\nhttp = {json.dumps(value)}\n')
        assert load_node_settings(cfg, read_environment({})).http == HostPort("127.0.0.1", 8081)


def test_environment_wins_over_the_config_artifact_transfer(tmp_path):
    from mesh_node.settings import load_node_settings

    cfg = _node_toml(tmp_path, 'identity = "k"\nartifact_transfer = "open"\n')
    env = read_environment({"MESH_LLM_ARTIFACT_TRANSFER": "off"})
    assert load_node_settings(cfg, env).artifact_transfer == "disabled"
    assert load_node_settings(cfg, read_environment({})).artifact_transfer == "open"
    cfg = _node_toml(tmp_path, 'identity = "k"\nartifact_transfer = "sometimes"\n')
    s = load_node_settings(cfg, read_environment({}))
    assert s.artifact_transfer == "disabled" and "sometimes" in s.warnings[0]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('identity = "k"\nlisten_address = "x"\n', "listen_address"),
        ('identity = "k"\nlisten = "nohost"\n', "listen"),
        ('identity = "k"\npeers = ["http://a:1"]\n', "peers"),
        ('identity = "k"\npeers = ["ws://a:1#ABC"]\n', "peers"),
        ('identity = "k"\ntrusted_owners = ["me"]\n', "trusted_owners"),
        ('identity = "k"\nmemory_budget = "lots"\n', "memory_budget"),
        ('identity = "k"\nheartbeat_interval_s = 0\n', "heartbeat_interval_s"),
        ('identity = "k"\npeer_loss_timeout_s = 1\nheartbeat_interval_s = 2\n',
         "peer_loss_timeout_s"),
        ('listen = "127.0.0.1:0"\n', "identity"),
        ('identity = "k"\nhttp = "localhost"\n', "http"),
        ('identity = "k"\nhttp = "127.0.0.1:8080"\nhttp_public = "yes"\n', "http_public"),
    ],
)
def test_bad_node_keys_are_usage_errors_naming_the_key(tmp_path, text, key):
    from mesh_node.settings import load_node_settings

    with pytest.raises(UsageError) as exc:
        load_node_settings(_node_toml(tmp_path, text), read_environment({}))
    assert key in exc.value.message and exc.value.exit_code == 2


@pytest.mark.parametrize(
    ("value", "size"),
    [(1024, 1024), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", 3 * 2**29),
     ("100", 100), ("8gib", 8 * 2**30)],
)
def test_memory_budget_units(value, size):
    from skippy.config import parse_size

    assert parse_size(value, "memory_budget") == size


def test_node_timeout_defaults_are_the_protocol_limits(tmp_path):
    from mesh_node.settings import load_node_settings
    from protocol.constants import DEFAULT_LIMITS

    cfg = tmp_path / "node.toml"
    cfg.write_text('identity = "node.key"\n')
    node = load_node_settings(cfg)
    assert node.handshake_timeout_s == DEFAULT_LIMITS.handshake_timeout_s
    assert node.idle_timeout_s == DEFAULT_LIMITS.idle_timeout_s


def test_swarm_transfer_is_on_by_default_and_must_be_a_boolean(tmp_path):
    """``swarm_transfer = false``: this node serves whole files only (no ranges, no lists)."""
    from mesh_node.settings import load_node_settings
    from skippy.errors import SkippyError

    env = read_environment({})
    assert load_node_settings(_node_toml(tmp_path, 'identity = "k"\n'), env).swarm_transfer
    off = _node_toml(tmp_path, 'identity = "k"\nswarm_transfer = false\n')
    assert load_node_settings(off, env).swarm_transfer is False
    with pytest.raises(SkippyError) as e:
        load_node_settings(_node_toml(tmp_path, 'identity = "k"\nswarm_transfer = "yes"\n'), env)
    assert "swarm_transfer" in e.value.message


def test_swarm_min_holders_is_gone_one_holder_is_a_swarm_of_one(tmp_path):
    """Every file is fetched by one engine, chunk by chunk from however many holders the
    signed list names: the holder-count switch no longer exists and is refused by name."""
    from mesh_node.settings import load_node_settings
    from skippy.errors import SkippyError

    env = read_environment({})
    toml = _node_toml(tmp_path, 'identity = "k"\nswarm_min_holders = 1\n')
    with pytest.raises(SkippyError) as e:
        load_node_settings(toml, env)
    assert e.value.code == "unknown_config_key" and "swarm_min_holders" in e.value.message


def test_serving_engine_llama_is_accepted_and_others_are_named():
    from mesh_node.settings import serving_settings

    assert serving_settings({"engine": "llama"}).engine == "llama"
    with pytest.raises(UsageError) as err:
        serving_settings({"engine": "vllm"})
    assert err.value.code == "invalid_config" and "llama" in err.value.message


def test_the_default_node_data_dir_follows_xdg():
    env = read_environment({"HOME": "/h"})
    assert env.node_data_dir == Path("/h/.local/share/mesh-node")
    env = read_environment({"HOME": "/h", "XDG_DATA_HOME": "/x/data"})
    assert env.node_data_dir == Path("/x/data/mesh-node")


def test_the_first_run_node_toml_is_read_by_the_one_reader(tmp_path):
    from mesh_node.settings import default_node_toml, load_node_settings

    (tmp_path / "node.toml").write_text(default_node_toml("node.key", "node.cert"))
    settings = load_node_settings(tmp_path / "node.toml")
    root = tmp_path.resolve()
    assert settings.identity_path == root / "node.key"
    assert settings.certificate_path == root / "node.cert"
    assert settings.data_dir == root and str(settings.listen) == "127.0.0.1:7000"
