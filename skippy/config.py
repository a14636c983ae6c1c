"""The one configuration reader: environment variables and the node TOML, into frozen objects.

Nothing else in the project reads ``os.environ`` or parses the TOML file; everything else
receives these objects. Units are in the names (``..._s``, ``..._bytes``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.errors import InputUnreadable, UsageError
from skippy.generation import SpeculativeOverrides, load_speculative_overrides

ENV_ARTIFACT_TRANSFER = "MESH_LLM_ARTIFACT_TRANSFER"
ENV_HF_ENDPOINT = "HF_ENDPOINT"
ENV_HF_OFFLINE = "HF_HUB_OFFLINE"
ENV_TRANSFORMERS_OFFLINE = "TRANSFORMERS_OFFLINE"  # huggingface_hub honours it too
ENV_HF_CACHE_LEGACY = "HUGGINGFACE_HUB_CACHE"
ENV_HF_CACHE = "HF_HUB_CACHE"
ENV_HF_HOME = "HF_HOME"
ENV_XDG_CACHE = "XDG_CACHE_HOME"
ENV_XDG_DATA = "XDG_DATA_HOME"  # the default data directory of `mesh-node serve` (no --config)
DATA_DIR_NAME = "mesh-node"
ENV_API_KEY = "MESH_NODE_API_KEY"  # one HTTP API key (mesh_node.http.keys; HttpSettings)
ENV_CALIBRATION = "MESH_NODE_CALIBRATION"  # auto | off (wins over the TOML key)

ArtifactTransfer = Literal["disabled", "trusted", "open"]
# Spec "Peer Cache Transfer" (mesh-llm's values, exactly): trimmed and lower-cased; anything else,
# or unset, is disabled. An unrecognised non-empty value is not an error (the default is the safe
# side) but gets one warning naming it.
_TRANSFER_WORDS: dict[str, ArtifactTransfer] = {
    **dict.fromkeys(("open", "1", "true", "on", "yes", "any", "public"), "open"),
    **dict.fromkeys(("trusted", "trust", "owner", "owners", "same-owner", "allowlist"), "trusted"),
}
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


# --- hub traffic policy (applied by skippy.consume.hub_policy) ----------
ENV_HUB_CONNECT_TIMEOUT = "SKIPPY_HUB_CONNECT_TIMEOUT_S"
ENV_HUB_READ_TIMEOUT = "SKIPPY_HUB_READ_TIMEOUT_S"
ENV_HUB_ATTEMPTS = "SKIPPY_HUB_ATTEMPTS"
ENV_HUB_BACKOFF = "SKIPPY_HUB_BACKOFF_S"
ENV_HUB_BACKOFF_MAX = "SKIPPY_HUB_BACKOFF_MAX_S"
ENV_HUB_RETRY_AFTER_MAX = "SKIPPY_HUB_RETRY_AFTER_MAX_S"


@dataclass(frozen=True)
class HubPolicy:
    """How every request to the hub behaves. ``attempts`` counts the first try; retries wait
    ``backoff_s`` doubling up to ``backoff_max_s``, with jitter (half fixed, half random), or
    the server's ``Retry-After`` when it asks for at most ``retry_after_max_s``."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0  # between two received bytes, not for a whole download
    attempts: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 60.0


def _hub_policy(env: Mapping[str, str]) -> HubPolicy:
    def number(name: str, default: float, *, minimum: float) -> float:
        raw = env.get(name, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"{name}={raw!r} is not a number", code="invalid_config") from None
        if not minimum <= value < float("inf"):
            raise UsageError(f"{name}={raw!r} must be at least {minimum}", code="invalid_config")
        return value

    d = HubPolicy()
    return HubPolicy(
        connect_timeout_s=number(ENV_HUB_CONNECT_TIMEOUT, d.connect_timeout_s, minimum=0.01),
        read_timeout_s=number(ENV_HUB_READ_TIMEOUT, d.read_timeout_s, minimum=0.01),
        attempts=int(number(ENV_HUB_ATTEMPTS, d.attempts, minimum=1)),
        backoff_s=number(ENV_HUB_BACKOFF, d.backoff_s, minimum=0),
        backoff_max_s=number(ENV_HUB_BACKOFF_MAX, d.backoff_max_s, minimum=0),
        retry_after_max_s=number(ENV_HUB_RETRY_AFTER_MAX, d.retry_after_max_s, minimum=0),
    )


@dataclass(frozen=True)
class Environment:
    """Every environment variable the project honours, read once."""

    # Spec "Consumer Validation": local package directories MAY keep SHA-256 verification behind
    # SKIPPY_VERIFY_PACKAGE_SHA. We keep the safe default: on unless set to 0/false/no/off.
    verify_local_sha256: bool = True
    # Spec "Peer Cache Transfer": not advertised or served by default; trusted or open opt in.
    # ``None``: the variable is unset (a node TOML's ``artifact_transfer`` then decides).
    artifact_transfer: ArtifactTransfer | None = None
    warnings: tuple[str, ...] = ()
    hf_endpoint: str | None = None
    hf_offline: bool = False
    # The hub cache, resolved here the way huggingface_hub does (HF_HUB_CACHE, then
    # HF_HOME/hub, then $XDG_CACHE_HOME/huggingface/hub) and passed to every hub call.
    hf_cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache/huggingface/hub")
    skippy_cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "skippy")
    # Where `mesh-node serve` without --config keeps its node (XDG: $XDG_DATA_HOME/mesh-node,
    # else ~/.local/share/mesh-node).
    node_data_dir: Path = field(
        default_factory=lambda: Path.home() / ".local" / "share" / DATA_DIR_NAME
    )
    hub_policy: HubPolicy = field(default_factory=HubPolicy)
    # MESH_NODE_API_KEY: a secret, kept out of repr (and so out of any log of this object).
    api_key: str | None = field(default=None, repr=False)
    # MESH_NODE_CALIBRATION: auto | off; ``None`` when unset (the TOML decides).
    calibration: str | None = None


def parse_artifact_transfer(raw: str, source: str) -> tuple[ArtifactTransfer, str | None]:
    """The spec's word table: (mode, a warning line when ``raw`` is set but not recognised).

    ``source`` names where the value came from (the variable or the TOML key) for the warning.
    """
    word = raw.strip().lower()
    mode = _TRANSFER_WORDS.get(word)
    if mode is not None:
        return mode, None
    if not word or word in ("disabled", "off", "0", "false", "no", "none"):
        return "disabled", None
    return "disabled", (
        f"{source}={raw.strip()!r} is not a recognised artifact transfer mode; peer artifact "
        "transfer stays disabled (use trusted or open)"
    )


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    env = os.environ if environ is None else environ
    transfer: ArtifactTransfer | None = None
    warnings: list[str] = []
    if ENV_ARTIFACT_TRANSFER in env:
        raw = env[ENV_ARTIFACT_TRANSFER]
        transfer, warning = parse_artifact_transfer(raw, ENV_ARTIFACT_TRANSFER)
        warnings += [warning] if warning else []
    home = Path(env.get("HOME", str(Path.home())))
    xdg = env.get(ENV_XDG_CACHE) or str(home / ".cache")
    data_home = Path(env.get(ENV_XDG_DATA) or str(home / ".local" / "share"))
    hf_home = env.get(ENV_HF_HOME) or str(Path(xdg) / "huggingface")
    hf_cache = env.get(ENV_HF_CACHE) or env.get(ENV_HF_CACHE_LEGACY) or str(Path(hf_home) / "hub")
    return Environment(
        verify_local_sha256=env.get(ENV_VERIFY_PACKAGE_SHA, "").strip().lower() not in _FALSE_WORDS,
        artifact_transfer=transfer,
        warnings=tuple(warnings),
        hf_endpoint=env.get(ENV_HF_ENDPOINT) or None,
        hf_offline=any(
            env.get(name, "").strip().lower() in _TRUE_WORDS
            for name in (ENV_HF_OFFLINE, ENV_TRANSFORMERS_OFFLINE)
        ),
        hf_cache_dir=Path(hf_cache).expanduser(),
        skippy_cache_dir=Path(xdg) / "skippy",
        node_data_dir=data_home.expanduser() / DATA_DIR_NAME,
        hub_policy=_hub_policy(env),
        api_key=env.get(ENV_API_KEY, "").strip() or None,
        calibration=env.get(ENV_CALIBRATION, "").strip().lower() or None,
    )


@dataclass(frozen=True)
class NodeConfig:
    """The node's TOML file. Sections other modules own are parsed by them from ``raw``."""

    path: Path | None
    speculative: SpeculativeOverrides
    raw: Mapping[str, Any] = field(default_factory=dict)


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file's tables; a missing or unreadable file is ``InputUnreadable``, bad TOML a
    usage error (both exit 2)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputUnreadable(f"{what} {path} does not exist", path=str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputUnreadable(f"cannot read {what} {path}: {exc}", path=str(path)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}", code="invalid_config") from exc


def load_node_config(path: Path | None, known_keys: frozenset[str] | None = None) -> NodeConfig:
    """Read a node TOML (``None``: an empty config). Bad TOML is a usage error (exit 2); with
    ``known_keys`` (the node's: ``mesh_node.settings.NODE_KEYS``), so is any other top-level
    key, named. Without, only the sections read here ([speculative], [models]) are checked."""
    if path is None:
        return NodeConfig(path=None, speculative=load_speculative_overrides({}))
    raw = read_toml(path)
    unknown = [] if known_keys is None else sorted(set(raw) - known_keys)
    if unknown and known_keys is not None:
        raise UsageError(
            f"{path}: unknown key {unknown[0]!r}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""),
            code="unknown_config_key",
            path=str(path),
            actual=unknown,
            remediation="known keys: " + ", ".join(sorted(known_keys)),
        )
    return NodeConfig(path=path, speculative=load_speculative_overrides(raw), raw=raw)


# --- validation helpers for every table of the TOML (mesh_node.settings uses them too) ----------
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def refuse_unknown_keys(raw: Mapping[str, Any], table: str, known: frozenset[str]) -> None:
    """A key of ``[table]`` that we do not read is an error naming it (a typo must not pass)."""
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UsageError(
            f"unknown key {table}.{unknown[0]}",
            code="unknown_config_key",
            path=f"{table}.{unknown[0]}",
            remediation="known keys: " + ", ".join(sorted(known)),
        )


def bad_value(key: str, message: str, value: object = None) -> UsageError:
    return UsageError(f"{key}: {message}", code="invalid_config", path=key, actual=value)


def parse_size(value: object, key: str) -> int:
    """Bytes from an integer or a string with a unit (``8GiB``, ``512 MiB``, ``2GB``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise bad_value(key, "expected a size such as 8GiB, 512MiB or a number of bytes", value)
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])


def positive_seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise bad_value(key, "expected a positive number of seconds", value)
    return float(value)


# --- [runtime]: where the stage runtime computes (skippy.runtime.devices) ----------------------
RUNTIME_KEYS = frozenset({"device", "placement", "cpu_moe", "device_fallback"})


@dataclass(frozen=True)
class PlacementRule:
    """``PATTERN=DEVICE``: weights whose name the pattern matches (searched, as llama.cpp's
    ``--override-tensor``) go to DEVICE."""

    pattern: str
    device: str

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def parse_rule(text: object, key: str = "runtime.placement") -> PlacementRule:
    """``"exps=CPU"`` as a rule; a malformed one is a usage error naming ``key``."""
    if not isinstance(text, str):
        raise bad_value(key, "expected PATTERN=DEVICE strings (for example exps=CPU)", text)
    pattern, sep, device = text.rpartition("=")
    if not sep or not pattern or not device.strip():
        raise bad_value(key, f"{text!r} is not PATTERN=DEVICE (for example exps=CPU)", text)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise bad_value(key, f"{pattern!r} is not a regular expression: {exc}", text) from exc
    return PlacementRule(pattern, device.strip())


@dataclass(frozen=True)
class RuntimeSettings:
    """``[runtime]`` of the node TOML: the device this node's stage runs on and where its
    weights go (docs/devices.md)."""

    device: str = "auto"  # "auto", "CPU", or a ggml device name (`mesh-node devices`)
    placement: tuple[PlacementRule, ...] = ()  # first match wins
    cpu_moe: bool = False  # routed experts in system memory
    device_fallback: bool = False  # a device without the memory: the CPU, logged


def runtime_settings(raw: object, device: str | None = None) -> RuntimeSettings:
    """Parse ``[runtime]`` (absent: the defaults); ``device``: a command line's choice,
    which wins over the file's."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise bad_value("runtime", "expected a table", raw)
    refuse_unknown_keys(raw, "runtime", RUNTIME_KEYS)
    chosen = raw.get("device", "auto") if device is None else device
    if not isinstance(chosen, str) or not chosen.strip():
        raise bad_value("runtime.device", 'expected "auto", "CPU" or a device name', chosen)
    rules = raw.get("placement", [])
    if not isinstance(rules, list):
        raise bad_value("runtime.placement", "expected a list of PATTERN=DEVICE strings", rules)
    flags = {}
    for key in ("cpu_moe", "device_fallback"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            raise bad_value(f"runtime.{key}", "expected true or false", flags[key])
    return RuntimeSettings(
        device=chosen.strip(),
        placement=tuple(parse_rule(r) for r in rules),
        cpu_moe=flags["cpu_moe"],
        device_fallback=flags["device_fallback"],
    )
