"""Examples quoted verbatim from the upstream layer package spec, shared by tests:
https://github.com/Mesh-LLM/mesh-llm/blob/main/docs/specs/layer-package-repos.md"""

from __future__ import annotations

from typing import Any

# "Execution Policy": the proposed glm-dsa-v1 generation block.
GLM_DSA_V1_GENERATION: dict[str, Any] = {
    "policy": {
        "profile": "glm-dsa-v1",
        "decode": "compact-flash",
        "short_prefill": "dense",
        "long_prefill": "sparse-chunked",
        "verify": "auto",
        "indexshare": "required",
    },
    "thresholds": {
        "short_prefill_max_tokens": 2048,
        "compact_flash_min_kv": 1,
        "dense_mask_max_bytes": 268435456,
    },
}
