"""Where a repo lives in the Hugging Face hub cache, without importing huggingface_hub's
client: ``huggingface_hub.constants`` is a light module, its ``file_download`` pulls the HTTP
stack (~0.3 s per process), and a mesh node needs the cache layout at start-up but the hub
client only when it falls back to the hub."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from huggingface_hub import constants

REPO_TYPE: Final = "model"


def repo_folder_name(repo_id: str, repo_type: str = REPO_TYPE) -> str:
    """``models--ns--name``: huggingface_hub's ``file_download.repo_folder_name`` rule (the
    cache's layout; tests/skippy/consume/test_hub.py holds the two equal)."""
    return constants.REPO_ID_SEPARATOR.join([f"{repo_type}s", *repo_id.split("/")])


def repo_cache_root(cache_dir: Path | str | None, repo_id: str) -> Path:
    """The repo's ``models--ns--name`` folder.

    Snapshot files are symlinks into ``blobs/``, so containment checks for cached files must
    resolve against this folder, not against ``snapshots/<commit>``. ``None`` keeps
    huggingface_hub's own default for library callers; our commands always pass the cache
    ``skippy.config`` resolved, so the environment is read in one place.
    """
    base = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    return base.expanduser().resolve() / repo_folder_name(repo_id)
