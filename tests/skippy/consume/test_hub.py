"""skippy.consume.hub through the real huggingface_hub client against the fake hub."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hubfaults import Fault, FaultyHub, running_hub

from mesh_node.lab.hub_server import write_tree
from skippy.config import HubPolicy
from skippy.consume.cache_layout import repo_cache_root, repo_folder_name
from skippy.consume.hub import (
    HubError,
    OfflineCacheMiss,
    download_file,
    download_many,
    resolve_revision,
)
from skippy.errors import EXIT_USAGE, ArtifactMissing, SkippyError, UnsafePath, UsageError
from skippy.package.refs import HfPackageRef

REPO = "ns/pkg"
REF = HfPackageRef(REPO)
FILES_V1 = {
    "model-package.json": b'{"version": 1}',
    "shared/metadata.gguf": b"M" * 700,
    "shared/embeddings.gguf": b"E" * 500,
    "shared/output.gguf": b"O" * 300,
    "layers/layer-00000.gguf": b"A" * 1000,
    "layers/layer-00001.gguf": b"B" * 1100,
}
FILES_V2 = {**FILES_V1, "model-package.json": b'{"version": 2}', "layers/layer-00001.gguf": b"C"}

# Our policy with millisecond waits; request counts (not clocks) show which retries ran.
FAST = HubPolicy(attempts=3, backoff_s=0.01, backoff_max_s=0.02)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FaultyHub]:
    with running_hub({REPO: write_tree(tmp_path / "v1", FILES_V1)}) as h:
        yield h


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _assert_no_hf_traceback(err: BaseException) -> None:
    assert isinstance(err, SkippyError)
    # nothing from huggingface_hub/httpx2 would be printed under our error
    assert err.__cause__ is None
    assert err.__suppress_context__ or err.__context__ is None


# --- resolve_revision ----------------------------------------------------------------------------
def test_resolve_branch_warns_and_returns_commit(
    hub: FaultyHub, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="skippy.consume.hub"):
        commit = resolve_revision(REF, endpoint=hub.url, cache_dir=cache)
    assert commit == hub.commit_of(REPO) and type(commit) is str
    warnings = [r for r in caplog.records if r.name == "skippy.consume.hub"]
    assert len(warnings) == 1
    assert "pin a commit" in warnings[0].getMessage()
    assert f"hf://{REPO}@{commit}" in warnings[0].getMessage()


def test_resolve_pinned_commit_needs_no_request_and_no_warning(
    hub: FaultyHub, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    commit = hub.commit_of(REPO)
    with caplog.at_level(logging.WARNING, logger="skippy.consume.hub"):
        assert resolve_revision(REF.at(commit), endpoint=hub.url, cache_dir=cache) == commit
    assert not [r for r in caplog.records if r.name == "skippy.consume.hub"]
    assert hub.request_log() == []


def test_resolve_tag(tmp_path: Path, cache: Path) -> None:
    with FaultyHub() as hub:
        old = hub.add_revision(REPO, write_tree(tmp_path / "v1", FILES_V1), tags=("v1",))
        new = hub.add_revision(REPO, write_tree(tmp_path / "v2", FILES_V2))
        assert old != new
        tagged = HfPackageRef(REPO, "v1")
        assert resolve_revision(tagged, endpoint=hub.url, cache_dir=cache) == old
        assert resolve_revision(REF, endpoint=hub.url, cache_dir=cache) == new


@pytest.mark.parametrize(
    ("ref", "code"),
    [
        (HfPackageRef(REPO, "nope"), "hub_revision_not_found"),
        (HfPackageRef("ns/absent"), "hub_repo_not_found"),
    ],
)
def test_resolve_not_found_is_typed(
    hub: FaultyHub, cache: Path, ref: HfPackageRef, code: str
) -> None:
    with pytest.raises(ArtifactMissing) as info:
        resolve_revision(ref, endpoint=hub.url, cache_dir=cache)
    assert info.value.code == code
    _assert_no_hf_traceback(info.value)


def test_resolve_unreachable_hub_is_hub_error(cache: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HubError) as info:
        resolve_revision(REF, endpoint=f"http://127.0.0.1:{port}", cache_dir=cache, policy=FAST)
    assert info.value.code == "hub_unreachable" and info.value.exit_code == EXIT_USAGE
    assert f"127.0.0.1:{port}" in info.value.message and "3 attempts" in info.value.message
    _assert_no_hf_traceback(info.value)


def test_resolve_hub_5xx_without_cache_is_hub_error(hub: FaultyHub, cache: Path) -> None:
    hub.inject(REPO, None, Fault.SERVER_ERROR)
    with pytest.raises(HubError) as info:
        resolve_revision(REF, endpoint=hub.url, cache_dir=cache, policy=FAST)
    assert info.value.code == "hub_http_error" and info.value.actual == 500
    assert len([r for r in hub.request_log() if r[2] == 500]) == FAST.attempts


# --- download_file -------------------------------------------------------------------------------
def test_download_file_lands_in_the_standard_cache(hub: FaultyHub, cache: Path) -> None:
    commit = resolve_revision(REF, endpoint=hub.url, cache_dir=cache)
    path = download_file(REF, commit, "layers/layer-00000.gguf", endpoint=hub.url, cache_dir=cache)
    root = repo_cache_root(cache, REPO)
    assert root == cache.resolve() / "models--ns--pkg"
    assert path == root / "snapshots" / commit / "layers" / "layer-00000.gguf"
    assert path.is_symlink()
    blob = path.resolve()
    assert blob.parent == root / "blobs"
    assert blob.name == _sha(FILES_V1["layers/layer-00000.gguf"])  # LFS etag = sha256
    assert path.read_bytes() == FILES_V1["layers/layer-00000.gguf"]
    assert (root / "refs" / "main").read_text() == commit  # hf tooling sees the branch


def test_pinned_commit_returns_old_content(tmp_path: Path, cache: Path) -> None:
    with FaultyHub() as hub:
        old = hub.add_revision(REPO, write_tree(tmp_path / "v1", FILES_V1))
        new = hub.add_revision(REPO, write_tree(tmp_path / "v2", FILES_V2))
        assert resolve_revision(REF, endpoint=hub.url, cache_dir=cache) == new
        got_new = download_file(REF, new, "model-package.json", endpoint=hub.url, cache_dir=cache)
        got_old = download_file(
            REF.at(old), old, "model-package.json", endpoint=hub.url, cache_dir=cache
        )
        assert got_new.read_bytes() == FILES_V2["model-package.json"]
        assert got_old.read_bytes() == FILES_V1["model-package.json"]
        assert old in str(got_old) and new in str(got_new)


def test_missing_file_is_artifact_missing_fast(hub: FaultyHub, cache: Path) -> None:
    commit = hub.commit_of(REPO)
    with pytest.raises(ArtifactMissing) as info:
        download_file(
            REF, commit, "layers/layer-00099.gguf", endpoint=hub.url, cache_dir=cache, policy=FAST
        )
    assert hub.stats(REPO, "layers/layer-00099.gguf").head_requests == 1  # a 404 is final
    err = info.value
    assert err.code == "missing_artifact" and err.path == "layers/layer-00099.gguf"
    assert isinstance(err, FileNotFoundError)
    _assert_no_hf_traceback(err)


def test_injected_404_is_artifact_missing(hub: FaultyHub, cache: Path) -> None:
    hub.inject(REPO, "shared/output.gguf", Fault.NOT_FOUND)
    with pytest.raises(ArtifactMissing) as info:
        download_file(
            REF, hub.commit_of(REPO), "shared/output.gguf", endpoint=hub.url, cache_dir=cache
        )
    assert info.value.code == "missing_artifact"


def test_unknown_commit_is_revision_not_found(hub: FaultyHub, cache: Path) -> None:
    with pytest.raises(ArtifactMissing) as info:
        download_file(REF, "f" * 40, "model-package.json", endpoint=hub.url, cache_dir=cache)
    assert info.value.code == "hub_revision_not_found"


def test_server_error_on_download_is_hub_error_fast(hub: FaultyHub, cache: Path) -> None:
    """A 5xx on the GET is retried by our policy only (``attempts`` GETs in all)."""
    hub.inject(REPO, "shared/metadata.gguf", Fault.SERVER_ERROR)
    with pytest.raises(HubError) as info:
        download_file(
            REF,
            hub.commit_of(REPO),
            "shared/metadata.gguf",
            endpoint=hub.url,
            cache_dir=cache,
            policy=FAST,
        )
    assert hub.stats(REPO, "shared/metadata.gguf").get_requests == FAST.attempts
    err = info.value
    assert (err.code, err.exit_code, err.actual) == ("hub_http_error", EXIT_USAGE, 500)
    _assert_no_hf_traceback(err)


def test_truncated_body_is_incomplete_download_and_leaves_nothing(
    hub: FaultyHub, cache: Path
) -> None:
    hub.inject(REPO, "shared/metadata.gguf", Fault.TRUNCATE)
    with pytest.raises(HubError) as info:
        download_file(
            REF, hub.commit_of(REPO), "shared/metadata.gguf", endpoint=hub.url, cache_dir=cache
        )
    assert info.value.code == "hub_incomplete_download"
    blobs = repo_cache_root(cache, REPO) / "blobs"
    assert [p.name for p in blobs.iterdir()] == []  # no partial or bogus blob kept


def test_flipped_byte_passes_the_clients_size_check(hub: FaultyHub, cache: Path) -> None:
    """huggingface_hub checks size only: corrupted bytes land in the cache under the declared
    sha256. This is why consumers must verify SHA-256 themselves (spec, Consumer Validation)."""
    relpath = "layers/layer-00001.gguf"
    hub.inject(REPO, relpath, Fault.FLIP_BYTE)
    path = download_file(REF, hub.commit_of(REPO), relpath, endpoint=hub.url, cache_dir=cache)
    data = path.read_bytes()
    assert len(data) == len(FILES_V1[relpath]) and data != FILES_V1[relpath]
    assert path.resolve().name == _sha(FILES_V1[relpath]) != _sha(data)


def test_unsafe_relpath_and_bad_commit_are_refused_before_any_request(
    hub: FaultyHub, cache: Path
) -> None:
    commit = hub.commit_of(REPO)
    for bad in ("../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b", "shared/"):
        with pytest.raises(UnsafePath):
            download_file(REF, commit, bad, endpoint=hub.url, cache_dir=cache)
    with pytest.raises(UsageError) as info:
        download_file(REF, "main", "model-package.json", endpoint=hub.url, cache_dir=cache)
    assert info.value.code == "invalid_commit"
    assert hub.request_log() == []


# --- counters: a stage fetch downloads exactly its parts ---------------------------------------
def test_download_many_fetches_exactly_the_requested_files(hub: FaultyHub, cache: Path) -> None:
    commit = resolve_revision(REF, endpoint=hub.url, cache_dir=cache)
    wanted = ["model-package.json", "shared/metadata.gguf", "layers/layer-00001.gguf"]
    got = download_many(REF, commit, wanted, endpoint=hub.url, cache_dir=cache)
    assert list(got) == wanted
    assert all(got[p].read_bytes() == FILES_V1[p] for p in wanted)
    assert hub.downloaded_paths(REPO) == set(wanted)
    for p in wanted:
        assert hub.get_count(REPO, p) == 1
        assert hub.bytes_served(REPO, p) == len(FILES_V1[p])
    # a second fetch is served from the cache: no further GET (or HEAD) for pinned commits
    hub.reset()
    again = download_many(REF, commit, wanted, endpoint=hub.url, cache_dir=cache)
    assert again == got
    assert hub.request_log() == []


# --- offline -------------------------------------------------------------------------------------
def test_offline_works_from_cache_without_the_hub(tmp_path: Path, cache: Path) -> None:
    wanted = ["model-package.json", "shared/embeddings.gguf"]
    with running_hub({REPO: write_tree(tmp_path / "v1", FILES_V1)}) as hub:
        url = hub.url
        commit = resolve_revision(REF, endpoint=url, cache_dir=cache)
        download_many(REF, commit, wanted, endpoint=url, cache_dir=cache)
    # the hub is gone; offline resolution reads refs/main, downloads come from snapshots/
    assert resolve_revision(REF, endpoint=url, cache_dir=cache, offline=True) == commit
    assert resolve_revision(REF.at(commit), endpoint=url, cache_dir=cache, offline=True) == commit
    got = download_many(REF, commit, wanted, endpoint=url, cache_dir=cache, offline=True)
    assert {p: got[p].read_bytes() for p in wanted} == {p: FILES_V1[p] for p in wanted}


def test_offline_lists_every_missing_file(hub: FaultyHub, cache: Path) -> None:
    commit = resolve_revision(REF, endpoint=hub.url, cache_dir=cache)
    download_file(REF, commit, "model-package.json", endpoint=hub.url, cache_dir=cache)
    hub.reset()
    wanted = ["model-package.json", "shared/output.gguf", "layers/layer-00000.gguf"]
    with pytest.raises(OfflineCacheMiss) as info:
        download_many(REF, commit, wanted, endpoint=hub.url, cache_dir=cache, offline=True)
    err = info.value
    assert isinstance(err, ArtifactMissing) and err.code == "not_in_offline_cache"
    assert err.missing == ("shared/output.gguf", "layers/layer-00000.gguf")
    assert "shared/output.gguf" in err.message and "layers/layer-00000.gguf" in err.message
    assert "model-package.json" not in err.message
    assert err.to_dict()["missing"] == list(err.missing)
    assert hub.request_log() == []
    _assert_no_hf_traceback(err)


def test_offline_resolution_without_cache_is_a_miss(hub: FaultyHub, cache: Path) -> None:
    with pytest.raises(OfflineCacheMiss) as info:
        resolve_revision(REF, endpoint=hub.url, cache_dir=cache, offline=True)
    assert info.value.missing == ("refs/main",)
    with pytest.raises(OfflineCacheMiss) as info:
        resolve_revision(REF.at("a" * 40), endpoint=hub.url, cache_dir=cache, offline=True)
    assert info.value.missing == (f"snapshots/{'a' * 40}",)
    assert hub.request_log() == []


# --- no traffic to a hub we were not pointed at --------------------------------------------------
def test_no_request_leaves_for_the_agent_registry(hub: FaultyHub, tmp_path: Path) -> None:
    """huggingface_hub 2.x builds its user agent by fetching ``{ENDPOINT}/api/agent-harnesses``
    (huggingface.co unless HF_ENDPOINT says otherwise) unless telemetry is off; a node must not
    call out to a hub it was not asked to use. The child points HF_ENDPOINT at the local hub so
    such a fetch would show in its request log."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from skippy.consume.hub import download_file\n"
        "from skippy.package.refs import HfPackageRef\n"
        "download_file(HfPackageRef(sys.argv[1]), sys.argv[4], 'model-package.json',\n"
        "              endpoint=sys.argv[2], cache_dir=Path(sys.argv[3]))\n"
    )
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": ""}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-c", code, REPO, hub.url, str(tmp_path / "c"), hub.commit_of(REPO)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    paths = [p for _, p, _ in hub.request_log()]
    assert any("model-package.json" in p for p in paths)
    assert not [p for p in paths if "agent-harnesses" in p]


@pytest.mark.parametrize("repo_id", [REPO, "meshllm/gemma-3-270m-Q4_K_M-layers", "solo"])
def test_the_cache_layout_is_huggingface_hubs(repo_id: str) -> None:
    from huggingface_hub.file_download import repo_folder_name as theirs

    assert repo_folder_name(repo_id) == theirs(repo_id=repo_id, repo_type="model")


def test_a_node_starts_without_importing_the_hub_client() -> None:
    """The hub client (~0.3 s of imports) loads when a node first falls back to the hub,
    not at start-up: not with the node's modules, nor with the stage resolver its start-up
    calibration runs on a local package."""
    code = (
        "import sys, mesh_node.node_process, mesh_node.cli, skippy.consume.resolve; "
        "print(sorted(m for m in ('huggingface_hub.hf_api', 'huggingface_hub.file_download') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
