"""Vocabulary of the layer-package format (spec: "Repository Layout", "Manifest Schema").

File names, manifest keys, limits and the runtime ABI live here and nowhere else.
"""

from __future__ import annotations

import re
from typing import Final

# --- manifest identity (spec "Manifest Schema") ---------------------------------------------
MANIFEST_NAME: Final = "model-package.json"
SCHEMA_VERSION: Final = 1
FORMAT: Final = "layer-package"
README_NAME: Final = "README.md"

# The llama/skippy ABI this runtime writes and accepts (spec "Compatibility": reject
# incompatible ABI versions rather than best-effort loading). Rule: same major, package
# minor <= runtime minor; see skippy.package.manifest.abi_compatible.
RUNTIME_ABI_VERSION: Final = "1.0.0"

# Peer transfer caps the manifest at 16 MiB (spec "Peer Cache Transfer"); we apply the same
# cap to every manifest we parse so a hostile file cannot make us allocate without bound.
MANIFEST_MAX_BYTES: Final = 16 * 1024 * 1024
# llama.cpp counts a split set's files in 16 bits, and a package is metadata + embeddings +
# one fragment per layer + output: more layers than this cannot load as one set.
MAX_LAYER_COUNT: Final = 0xFFFF - 3

# Bounds of the manifest's integer fields (every integer is bounded; docs/cli.md).
# A field outside its range is invalid_manifest naming the field; a JSON integer literal longer
# than MAX_INT_DIGITS is refused before Python converts it.
MAX_ARTIFACT_BYTES: Final = 2**53 - 1  # ~9 PB; also the largest integer a JSON double holds
MAX_ARTIFACT_TENSORS: Final = 1 << 20  # the GGUF reader's own tensor-count bound
MAX_ACTIVATION_WIDTH: Final = 1 << 20
MAX_UNIX_SECS: Final = 253_402_300_799  # 9999-12-31T23:59:59Z
MAX_INT_DIGITS: Final = 20  # 2**64 - 1 has 20 digits

# --- layout (spec "Repository Layout") --------------------------------------------------------
SHARED_DIR: Final = "shared"
LAYERS_DIR: Final = "layers"
PROJECTORS_DIR: Final = "projectors"
METADATA_PATH: Final = "shared/metadata.gguf"
EMBEDDINGS_PATH: Final = "shared/embeddings.gguf"
OUTPUT_PATH: Final = "shared/output.gguf"
LAYER_INDEX_DIGITS: Final = 5
# The only folders whose files a rewrite may delete (never the manifest or README at the root).
ARTIFACT_DIRS: Final = (SHARED_DIR, LAYERS_DIR, PROJECTORS_DIR)


def layer_path(index: int) -> str:
    return f"{LAYERS_DIR}/layer-{index:0{LAYER_INDEX_DIGITS}d}.gguf"


# --- artifact roles -----------------------------------------------------------------------------
ROLE_METADATA: Final = "metadata"
ROLE_EMBEDDINGS: Final = "embeddings"
ROLE_OUTPUT: Final = "output"
ROLE_LAYER: Final = "layer"
ROLE_PROJECTOR: Final = "projector"
SHARED_ROLES: Final = (ROLE_METADATA, ROLE_EMBEDDINGS, ROLE_OUTPUT)

PROJECTOR_KINDS: Final = frozenset({"mmproj"})
PROJECTOR_ARCHITECTURE: Final = "clip"  # general.architecture of llama.cpp's mmproj files
DEFAULT_PROJECTOR_KIND: Final = "mmproj"

# --- tensor ownership ------------------------------------------------------
BLOCK_TENSOR_RE: Final = re.compile(r"\Ablk\.(\d+)\.", re.ASCII)
EMBEDDING_TENSOR_PREFIXES: Final = ("token_embd.", "per_layer_token_embd.", "token_embd_norm.")
OUTPUT_TENSOR_PREFIXES: Final = ("output.", "output_norm.")
OUTPUT_WEIGHT_TENSOR: Final = "output.weight"
TOKEN_EMBEDDING_TENSOR: Final = "token_embd.weight"

# --- llama.cpp split-set keys (every fragment is one split of one loadable set) ----------------
KEY_SPLIT_NO: Final = "split.no"
KEY_SPLIT_COUNT: Final = "split.count"
KEY_SPLIT_TENSORS_COUNT: Final = "split.tensors.count"
SPLIT_KEYS: Final = frozenset({KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS_COUNT})
# A model coordinate ORG/REPO:DISTRIBUTION (spec "Manifest Schema": model_id).
MODEL_COORDINATE_RE: Final = re.compile(r"\A[A-Za-z0-9][\w.-]*/[\w.-]+:[\w.+-]+\Z", re.ASCII)
SPLIT_SHARD_RE: Final = re.compile(
    r"\A(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf\Z", re.ASCII
)

# --- keys our fragments carry so each one is self-describing ------------------------------------
KEY_ARCHITECTURE: Final = "general.architecture"
KEY_GENERAL_TYPE: Final = "general.type"
KEY_ALIGNMENT: Final = "general.alignment"
KEY_FRAGMENT_ROLE: Final = "skippy.fragment.role"
KEY_FRAGMENT_LAYER_START: Final = "skippy.fragment.layer_start"
KEY_FRAGMENT_LAYER_STOP: Final = "skippy.fragment.layer_stop"
FRAGMENT_KEEP_KEYS: Final = (KEY_ARCHITECTURE, KEY_ALIGNMENT)


# --- keys of a materialized (derived, per-stage) GGUF ---------------------------------------------
MATERIALIZED_KEY_PREFIX: Final = "skippy.materialized."
KEY_MATERIALIZED_CACHE_KEY: Final = MATERIALIZED_KEY_PREFIX + "cache_key"
KEY_MATERIALIZED_MANIFEST_SHA256: Final = MATERIALIZED_KEY_PREFIX + "manifest_sha256"
KEY_MATERIALIZED_LAYER_START: Final = MATERIALIZED_KEY_PREFIX + "layer_start"
KEY_MATERIALIZED_LAYER_STOP: Final = MATERIALIZED_KEY_PREFIX + "layer_stop"
KEY_MATERIALIZED_LAYER_COUNT: Final = MATERIALIZED_KEY_PREFIX + "layer_count"
# Every skippy.fragment.* key describes one fragment, not the composed file.
FRAGMENT_KEY_PREFIX: Final = KEY_FRAGMENT_ROLE.rpartition(".")[0] + "."


def arch_key(arch: str, name: str) -> str:
    """``<arch>.block_count`` and friends."""
    return f"{arch}.{name}"


# --- mixture of experts (gguf-py's Keys.LLM and TENSOR_NAMES;
# tests/skippy/package/test_experts.py checks) ---------------------------------------------------
# Per-architecture keys, each ``arch_key(arch, name)``.
EXPERT_COUNT_KEY: Final = "expert_count"
EXPERT_USED_COUNT_KEY: Final = "expert_used_count"
EXPERT_FF_LENGTH_KEY: Final = "expert_feed_forward_length"
EMBEDDING_LENGTH_KEY: Final = "embedding_length"
# Routed experts: one tensor holds every expert's matrix, the experts along its last GGUF
# dimension (ne2 of a weight, ne1 of a bias). ``gate_up`` is the fused gate and up projection.
EXPERT_TENSOR_KINDS: Final = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
ROUTER_TENSOR_KIND: Final = "ffn_gate_inp"  # (width, expert_count): one logit per expert


# --- environment (read only through skippy.config) ----------------------------------------------
ENV_VERIFY_PACKAGE_SHA: Final = "SKIPPY_VERIFY_PACKAGE_SHA"

# \A...\Z, not ^...$: "$" also matches before a trailing newline.
SHA256_HEX_RE: Final = re.compile(r"\A[0-9a-fA-F]{64}\Z", re.ASCII)


# --- package schema version 2 (docs/layer-packages.md "Package v2") ------------------------
# Upstream's "source-complete" format: a closed JSON root, a metadata carrier GGUF with typed
# locator arrays, and payload GGUFs (common group, one group per layer, split into -partNN).
SCHEMA_VERSION_V2: Final = 2
FORMAT_V2: Final = "gguf"
SCHEMA_VERSIONS: Final = (SCHEMA_VERSION, SCHEMA_VERSION_V2)
V2_METADATA_ARTIFACT_ID: Final = "metadata"
V2_COMMON_ID: Final = "common"
V2_COMMON_DIR_PATH: Final = "shared/common"
V2_GENERATOR_VERSION: Final = "skippy-py-0.1"  # ours: provenance only (spec "v2 root")
V2_NATIVE_ABI_VERSION: Final = RUNTIME_ABI_VERSION  # provenance only (spec "v2 loading")
V2_DEFAULT_MAX_ARTIFACT_BYTES: Final = 8 * 1024**3  # spec "v2 parts"
V2_MANIFEST_TMP_NAME: Final = ".skippy-model-package-v2.json.tmp"
V2_HEADERS_DIR: Final = ".headers"
V2_ARTIFACT_ID_RE: Final = re.compile(r"\A[A-Za-z0-9._-]+\Z", re.ASCII)
V2_SHA256_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z", re.ASCII)  # lowercase only in v2
V2_PACKAGE_ID_RE: Final = re.compile(r"\Asha256:[0-9a-f]{64}\Z", re.ASCII)
# layers/layer-NNNNN.gguf or layers/layer-NNNNN-partMM.gguf -> layer ordinal N (spec "v2 carrier")
V2_LAYER_PATH_RE: Final = re.compile(r"\Alayers/layer-(\d{5})(?:-part(\d{2}))?\.gguf\Z", re.ASCII)
V2_COMMON_PATH_RE: Final = re.compile(r"\Ashared/common(?:-part(\d{2}))?\.gguf\Z", re.ASCII)
ROLE_COMMON: Final = "common"  # a v2 common-group artifact: every non-layer tensor
ROLE_PUBLISHER: Final = "publisher"  # a v2 publisher-metadata file (never loaded)
# Carrier keys (spec "v2 carrier")
KEY_V2_METADATA_ONLY: Final = "skippy.package.metadata_only"
KEY_V2_PART_COUNT: Final = "skippy.package.part_count"
KEY_V2_LOCATOR_SCHEMA: Final = "skippy.package.locator_schema"
KEY_V2_TENSOR_PART: Final = "skippy.package.tensor_part"
KEY_V2_TENSOR_OFFSET: Final = "skippy.package.tensor_offset"
KEY_V2_TENSOR_SIZE: Final = "skippy.package.tensor_size"
KEY_V2_TENSOR_ALIGNMENT: Final = "skippy.package.tensor_alignment"
V2_LOCATOR_SCHEMA: Final = 1
V2_CARRIER_KEYS: Final = (
    KEY_V2_METADATA_ONLY,
    KEY_V2_PART_COUNT,
    KEY_V2_LOCATOR_SCHEMA,
    KEY_V2_TENSOR_PART,
    KEY_V2_TENSOR_OFFSET,
    KEY_V2_TENSOR_SIZE,
    KEY_V2_TENSOR_ALIGNMENT,
)
# Environment of --after-artifact-command (spec "v2 hook")
ENV_ARTIFACT_PATH: Final = "SKIPPY_PACKAGE_ARTIFACT_PATH"
ENV_ARTIFACT_RELATIVE_PATH: Final = "SKIPPY_PACKAGE_ARTIFACT_RELATIVE_PATH"


def v2_layer_id(index: int, part: int | None = None) -> str:
    base = f"layer-{index:0{LAYER_INDEX_DIGITS}d}"
    return base if part is None else f"{base}-part{part:02d}"


def v2_layer_path(index: int, part: int | None = None) -> str:
    return f"{LAYERS_DIR}/{v2_layer_id(index, part)}.gguf"


def v2_common_id(part: int | None = None) -> str:
    return V2_COMMON_ID if part is None else f"{V2_COMMON_ID}-part{part:02d}"


def v2_common_path(part: int | None = None) -> str:
    return f"{SHARED_DIR}/{v2_common_id(part)}.gguf"
