"""Why a stage of a split failed, and whether trying again can help (the pure decisions).

A stage node reports a failed stage with the stable code of what went wrong. Some failures are
**permanent**: the same package on the same runtime fails the same way however often it is
tried (an architecture the stage runtime does not run, a malformed or inconsistent package, a
plan that does not fit the nodes' memory). Others are **transient**: a hub or a peer that did
not answer, a link lost, a disk error, a bug of ours. A split with a permanent failure is
*failed*: it says so at once, with the stage's code and reason, and is planned again only when
a peer joins (the new plan may put the stage elsewhere); a transient one is retried, with a
backoff.

``classify_failure`` gives a code's kind. A code this table does not know is transient:
retrying what might recover costs a little time, giving up on it would need an operator.
"""

from __future__ import annotations

from typing import Final, Literal

FailureKind = Literal["permanent", "transient"]

# A prefix is a family of codes that all mean "this model or package cannot run here":
# GGUF container violations, fragments that disagree with the manifest, features the stage
# runtime does not implement.
PERMANENT_PREFIXES: Final = ("gguf_", "fragment_", "unsupported_")
PERMANENT_CODES: Final = frozenset(
    {
        # the stage runtime cannot run this model
        "stage_unsupported",
        "partial_range_unsupported",
        "missing_hyperparameter",
        "invalid_hyperparameters",
        "invalid_model",
        "runtime_load_failed",
        "ggml_version_mismatch",
        # the package is invalid (its manifest, its files, their hashes)
        "package_invalid",
        "invalid_manifest",
        "invalid_manifest_json",
        "manifest_sha256_mismatch",
        "manifest_too_large",
        "duplicate_manifest_key",
        "missing_layer",
        "duplicate_layer",
        "layer_count_too_large",
        "invalid_metadata_artifact",
        "invalid_quantization_block",
        "artifact_sha256_mismatch",
        "artifact_size_mismatch",
        "unsafe_artifact_path",
        "package_storage_mismatch",
        "ineligible_package_ref",
        "tokenizer_load_failed",
        # the plan does not fit the nodes' memory
        "topology_does_not_fit",
    }
)


def classify_failure(code: str | None) -> FailureKind:
    """``permanent`` when trying the same stage again cannot succeed, else ``transient``."""
    if code is None:
        return "transient"
    if code in PERMANENT_CODES or code.startswith(PERMANENT_PREFIXES):
        return "permanent"
    return "transient"

