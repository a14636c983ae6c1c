"""A source model named by a hub coordinate ``org/repo:DISTRIBUTION`` (spec "Publishing
Rules": ``write-package org/repo:distribution``).

The repository's GGUF files are listed through huggingface_hub, the one file (or the one
llama.cpp split set) whose name carries the distribution is chosen by a pure rule, every
shard is downloaded into the standard hub cache, and the provenance fields come from the hub:
the repo, the resolved commit and the file path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from skippy.config import Environment
from skippy.constants import MODEL_COORDINATE_RE, SHA256_HEX_RE, SPLIT_SHARD_RE
from skippy.consume import hub
from skippy.consume.cache_layout import repo_cache_root
from skippy.errors import IntegrityError, UsageError
from skippy.hashing import sha256_files
from skippy.package.refs import HfPackageRef
from skippy.paths import is_within
from skippy.produce.write_package import Provenance

PROJECTOR_PREFIX = "mmproj"


def parse_model_coordinate(text: str) -> tuple[str, str] | None:
    """``org/repo:DIST`` -> (repo_id, distribution); None if ``text`` is not one."""
    m = MODEL_COORDINATE_RE.match(text)
    if not m:
        return None
    repo, _, dist = text.rpartition(":")
    return repo, dist


def _stem_and_shard(path: str) -> tuple[str, int | None, int | None]:
    name = PurePosixPath(path).name
    m = SPLIT_SHARD_RE.match(name)
    if m:
        return m.group("prefix"), int(m.group("no")), int(m.group("count"))
    return name[: -len(".gguf")], None, None


# A quantization name as llama.cpp and the hub spell them: Q4_K_M, Q8_0, IQ4_XS, TQ1_0, F16,
# BF16, MXFP4, Q4_0_4_4... Prefix tokens that belong to a recipe's name go in _RECIPE_PREFIXES
# (Unsloth's dynamic "UD-Q4_K_XL" is a different distribution from "Q4_K_XL").
_QUANT_TOKEN_RE = re.compile(r"(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d+_\d+|B?F\d+|FP\d+|MXFP\d+)", re.I)
_RECIPE_PREFIXES = frozenset({"ud"})


def distribution_label(stem: str) -> str:
    """The distribution a GGUF file stem names (pure): its trailing quantization tokens with
    any recipe prefix (``Qwen3-8B-UD-Q4_K_XL`` -> ``UD-Q4_K_XL``, ``llama-2-7b.Q4_K_M`` ->
    ``Q4_K_M``); a stem without one names its last ``-``/``.`` token (``tiny-SPLIT`` ->
    ``SPLIT``)."""
    _, dot, tail = stem.rpartition(".")
    if dot and _QUANT_TOKEN_RE.fullmatch(tail):
        return tail
    tokens = stem.split("-")
    i = len(tokens)
    while i > 0 and _QUANT_TOKEN_RE.fullmatch(tokens[i - 1]):
        i -= 1
    if i < len(tokens):
        if i > 0 and tokens[i - 1].lower() in _RECIPE_PREFIXES:
            i -= 1
        return "-".join(tokens[i:])
    return re.split(r"[-.]", stem)[-1]


def _names_distribution(path: str, dist: str) -> bool:
    """The file's distribution label is exactly ``dist`` (case-insensitive), or the file sits
    in a folder named exactly after it (``UD-Q4_K_XL/model-00001-of-00003.gguf``)."""
    stem, _, _ = _stem_and_shard(path)
    d = dist.lower()
    if distribution_label(stem).lower() == d:
        return True
    return any(part.lower() == d for part in PurePosixPath(path).parts[:-1])


def _model_ggufs(files: list[str]) -> list[str]:
    """The repository's model GGUFs: projectors (``mmproj*``) never count."""
    return [
        f
        for f in files
        if f.endswith(".gguf") and not PurePosixPath(f).name.lower().startswith(PROJECTOR_PREFIX)
    ]


def choose_distribution_files(files: list[str], dist: str) -> list[str]:
    """The repo paths of the distribution's GGUF: one file, or every shard in order.

    Pure. Projector GGUFs (``mmproj*``) never count. No match, several candidate models, or
    an incomplete split set are errors that list what the repository holds.
    """
    ggufs = _model_ggufs(files)
    matches = [f for f in ggufs if _names_distribution(f, dist)]
    groups: dict[tuple[str, str], list[str]] = {}
    for f in matches:
        stem, _, _ = _stem_and_shard(f)
        groups.setdefault((str(PurePosixPath(f).parent), stem), []).append(f)
    available = ", ".join(ggufs) or "no GGUF files"
    if not groups:
        raise UsageError(
            f"no GGUF in the repository names distribution {dist!r} exactly (it holds: "
            f"{available})",
            code="distribution_not_found",
            remediation="name the file with --source-file",
        )
    if len(groups) > 1:
        raise UsageError(
            f"distribution {dist!r} is ambiguous: "
            + "; ".join(", ".join(g) for g in groups.values()),
            code="ambiguous_distribution",
            remediation="name the file with --source-file",
        )
    (chosen,) = groups.values()
    return _complete_set(chosen, dist)


def choose_source_file(files: list[str], source_file: str) -> list[str]:
    """``--source-file`` for a hub coordinate (pure): that GGUF, or the split set whose first
    shard it names, every shard in order."""
    ggufs = _model_ggufs(files)
    if source_file not in ggufs:
        raise UsageError(
            f"--source-file {source_file!r} is not a model GGUF of the repository (it holds: "
            f"{', '.join(ggufs) or 'no GGUF files'})",
            code="source_file_not_found",
        )
    stem, no, _ = _stem_and_shard(source_file)
    if no is None:
        return [source_file]
    if no != 1:
        raise UsageError(
            f"--source-file {source_file!r} is shard {no} of a split set; name the first shard",
            code="not_first_shard",
        )
    parent = str(PurePosixPath(source_file).parent)
    siblings = [
        f for f in ggufs if str(PurePosixPath(f).parent) == parent and _stem_and_shard(f)[0] == stem
    ]
    return _complete_set(siblings, source_file)


def _complete_set(chosen: list[str], what: str) -> list[str]:
    """One plain GGUF, or a complete split set in shard order."""
    numbers = {f: _stem_and_shard(f)[1:] for f in chosen}  # (shard number, shard count)
    if len(chosen) == 1 and numbers[chosen[0]] == (None, None):
        return list(chosen)  # one plain GGUF
    shards = sorted(chosen, key=lambda f: numbers[f][0] or 0)
    counts = {count for _, count in numbers.values()}
    complete = (
        len(counts) == 1
        and None not in counts
        and [numbers[f][0] for f in shards] == list(range(1, len(shards) + 1))
        and counts == {len(shards)}
    )
    if not complete:
        raise UsageError(
            f"split set for {what!r} is incomplete or inconsistent: {', '.join(shards)}",
            code="missing_split_shard",
        )
    return shards


def _verify_lfs_digests(local: dict[str, Path], repo_root: Path) -> None:
    """huggingface_hub checks sizes only (runtime-facts.md); an LFS blob is named by its SHA-256, so
    each downloaded shard can be proven before it becomes a package's provenance. A corrupt
    shard is evicted from the cache (the next attempt downloads it again) and refused."""
    names = list(local)
    blobs = [local[n].resolve() for n in names]
    expected = [b.name.lower() if SHA256_HEX_RE.match(b.name) else None for b in blobs]
    checked = [i for i, e in enumerate(expected) if e is not None]
    digests = sha256_files([blobs[i] for i in checked])
    bad = [names[i] for i, d in zip(checked, digests, strict=True) if d != expected[i]]
    for name in bad:
        blob = local[name].resolve()
        local[name].unlink(missing_ok=True)
        if is_within(blob, repo_root):
            blob.unlink(missing_ok=True)
    if bad:
        raise IntegrityError(
            f"downloaded {', '.join(bad)} does not match the hub's SHA-256 for it: the download "
            "is corrupt",
            path=bad[0],
            paths=tuple(bad),
            remediation="the corrupt copy was removed from the hub cache; run the command again",
        )


@dataclass(frozen=True)
class HubModelSource:
    first_shard: Path  # local path in the hub cache; siblings sit next to it
    provenance: Provenance
    files: tuple[str, ...]


def fetch_model_source(
    coordinate: str, revision: str | None, env: Environment, *, source_file: str | None = None
) -> HubModelSource:
    parsed = parse_model_coordinate(coordinate)
    if parsed is None:
        raise UsageError(
            f"{coordinate!r} is neither a local file nor a model coordinate ORG/REPO:DIST",
            code="invalid_model_id",
        )
    repo_id, dist = parsed
    ref = HfPackageRef(repo_id, revision)
    endpoint, cache_dir, offline = env.hf_endpoint, env.hf_cache_dir, env.hf_offline
    policy = env.hub_policy
    commit = hub.resolve_revision(
        ref, endpoint=endpoint, cache_dir=cache_dir, offline=offline, policy=policy
    )
    listing = hub.list_files(ref, commit, endpoint=endpoint, offline=offline, policy=policy)
    files = (
        choose_source_file(listing, source_file)
        if source_file is not None
        else choose_distribution_files(listing, dist)
    )
    local = hub.download_many(
        ref, commit, files, endpoint=endpoint, cache_dir=cache_dir, offline=offline, policy=policy
    )
    _verify_lfs_digests(local, repo_cache_root(cache_dir, repo_id))
    return HubModelSource(
        first_shard=local[files[0]],
        provenance=Provenance(
            model_id=coordinate, repo=repo_id, revision=commit, source_file=files[0]
        ),
        files=tuple(files),
    )
