"""The fake hub speaks enough of the Hub API for the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest
from hubfaults import Fault, FaultyHub, running_hub
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get

from mesh_node.lab.hub_server import write_tree

REPO = "ns/pkg"
FILES_V1 = {
    "model-package.json": b'{"v": 1}',
    "shared/metadata.gguf": bytes(range(256)) * 4,
    "layers/layer-00000.gguf": b"L0" * 300,
    "layers/layer-00001.gguf": b"L1" * 300,
}
FILES_V2 = {**FILES_V1, "model-package.json": b'{"v": 2}'}


@pytest.fixture(autouse=True)
def raw_client() -> Iterator[None]:
    """These tests look at the fake server through huggingface_hub's own client, without our
    retry policy (skippy.consume.hub_policy installs one process-wide once a hub call ran)."""
    from skippy.consume.hub_policy import uninstall

    uninstall()
    yield
    uninstall()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FaultyHub]:
    with running_hub({REPO: write_tree(tmp_path / "v1", FILES_V1)}) as h:
        yield h


def _request(
    hub: FaultyHub, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A raw request: http.client does not normalise '..' away, unlike httpx."""
    parts = urlsplit(hub.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_resolve_head_carries_the_metadata_the_client_needs(hub: FaultyHub) -> None:
    data = FILES_V1["shared/metadata.gguf"]
    status, headers, body = _request(hub, "HEAD", f"/{REPO}/resolve/main/shared/metadata.gguf")
    assert status == 200 and body == b""
    sha = hashlib.sha256(data).hexdigest()
    assert headers["X-Repo-Commit"] == hub.commit_of(REPO)
    assert headers["X-Linked-Etag"] == f'"{sha}"' == headers["ETag"]
    assert headers["X-Linked-Size"] == headers["Content-Length"] == str(len(data))
    assert headers["Accept-Ranges"] == "bytes"
    assert not [k for k in headers if k.lower().startswith("x-xet")]
    assert "Location" not in headers


@pytest.mark.parametrize(
    ("range_header", "start", "stop"),
    [
        ("bytes=10-19", 10, 20),
        ("bytes=1000-", 1000, 1024),
        ("bytes=-24", 1000, 1024),
        ("bytes=5-99999", 5, 1024),
    ],
)
def test_range_requests_get_206(hub: FaultyHub, range_header: str, start: int, stop: int) -> None:
    data = FILES_V1["shared/metadata.gguf"]
    path = f"/{REPO}/resolve/main/shared/metadata.gguf"
    status, headers, body = _request(hub, "GET", path, {"Range": range_header})
    assert status == 206
    assert body == data[start:stop]
    assert headers["Content-Range"] == f"bytes {start}-{stop - 1}/{len(data)}"
    assert hub.stats(REPO, "shared/metadata.gguf").bytes_served == stop - start


def test_unsatisfiable_range_is_416(hub: FaultyHub) -> None:
    path = f"/{REPO}/resolve/main/shared/metadata.gguf"
    status, headers, _ = _request(hub, "GET", path, {"Range": "bytes=5000-"})
    assert status == 416 and headers["Content-Range"] == "bytes */1024"


def test_client_resume_uses_range(hub: FaultyHub) -> None:
    """huggingface_hub's own resume path (http_get with resume_size) gets the tail via Range."""
    data = FILES_V1["shared/metadata.gguf"]
    buf = io.BytesIO()
    buf.write(data[:600])
    url = f"{hub.url}/{REPO}/resolve/main/shared/metadata.gguf"
    http_get(url, buf, resume_size=600, expected_size=len(data))
    assert buf.getvalue() == data
    assert hub.bytes_served(REPO, "shared/metadata.gguf") == len(data) - 600


def test_model_info_and_revisions(tmp_path: Path) -> None:
    v1 = write_tree(tmp_path / "v1", FILES_V1)
    v2 = write_tree(tmp_path / "v2", FILES_V2)
    with FaultyHub() as hub:
        c1 = hub.add_revision(REPO, v1, tags=("v1.0",))
        c2 = hub.add_revision(REPO, v2)
        api = HfApi(endpoint=hub.url)
        assert c1 != c2 and len(c1) == len(c2) == 40
        assert api.model_info(REPO).sha == c2
        assert api.model_info(REPO, revision="main").sha == c2
        assert api.model_info(REPO, revision="v1.0").sha == c1
        assert api.model_info(REPO, revision=c1).sha == c1
        info = api.model_info(REPO, files_metadata=True)
        assert info.id == REPO
        siblings = {s.rfilename: s for s in info.siblings or []}
        assert set(siblings) == set(FILES_V2)
        meta = siblings["shared/metadata.gguf"]
        assert meta.size == 1024 and meta.lfs is not None
        assert meta.lfs.sha256 == hashlib.sha256(FILES_V2["shared/metadata.gguf"]).hexdigest()
        # without blobs=true the Hub sends names only
        assert all(s.size is None for s in api.model_info(REPO).siblings or [])
        with pytest.raises(RevisionNotFoundError):
            api.model_info(REPO, revision="nope")
        with pytest.raises(RevisionNotFoundError):
            api.model_info(REPO, revision="f" * 40)
        with pytest.raises(RepositoryNotFoundError):
            api.model_info("ns/absent")


def test_commit_is_deterministic(tmp_path: Path) -> None:
    a = write_tree(tmp_path / "a", FILES_V1)
    b = write_tree(tmp_path / "b", FILES_V1)
    with FaultyHub() as one, FaultyHub() as two:
        assert one.add_revision(REPO, a) == two.add_revision(REPO, b)
        assert one.add_revision("ns/other", a) != one.commit_of(REPO)


def test_tree_listing_and_pagination(tmp_path: Path) -> None:
    with running_hub({REPO: write_tree(tmp_path / "v1", FILES_V1)}, tree_page_size=2) as hub:
        api = HfApi(endpoint=hub.url)
        entries = list(api.list_repo_tree(REPO, recursive=True))
        files = {e.path: e for e in entries if hasattr(e, "size")}
        assert set(files) == set(FILES_V1)
        assert {e.path for e in entries} - set(files) == {"layers", "shared"}
        lfs = files["layers/layer-00001.gguf"].lfs  # type: ignore[union-attr]
        assert lfs is not None and lfs.sha256 == hashlib.sha256(b"L1" * 300).hexdigest()
        tree_gets = [p for m, p, s in hub.request_log() if "/tree/" in p]
        assert len(tree_gets) == 3  # 6 entries, 2 per page, followed via Link rel="next"
        top = {e.path for e in api.list_repo_tree(REPO)}
        assert top == {"model-package.json", "layers", "shared"}
        sub = {e.path for e in api.list_repo_tree(REPO, path_in_repo="layers")}
        assert sub == {"layers/layer-00000.gguf", "layers/layer-00001.gguf"}


def test_hf_hub_download_and_typed_errors_are_not_retried(hub: FaultyHub, tmp_path: Path) -> None:
    """A 404 of each kind maps to the client's typed error on the first answer: one request
    each, no retry loop (a retry storm would be the way such a test hangs)."""
    cache = tmp_path / "cache"
    local = hf_hub_download(REPO, "layers/layer-00000.gguf", cache_dir=cache, endpoint=hub.url)
    assert Path(local).read_bytes() == FILES_V1["layers/layer-00000.gguf"]
    before = len(hub.request_log())
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "layers/absent.gguf", cache_dir=cache, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(
            REPO, "model-package.json", revision="nope", cache_dir=cache, endpoint=hub.url
        )
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("ns/absent", "model-package.json", cache_dir=cache, endpoint=hub.url)
    failed = hub.request_log()[before:]
    assert [status for _, _, status in failed] == [404, 404, 404], failed


@pytest.mark.parametrize(
    "path",
    [
        f"/{REPO}/resolve/main/../../etc/passwd",
        f"/{REPO}/resolve/main/shared/%2e%2e/model-package.json",
        f"/{REPO}/resolve/main/shared%2F..%2Fmodel-package.json",
        f"/{REPO}/resolve/main//etc/passwd",
        f"/{REPO}/resolve/main/shared/%00",
        f"/{REPO}/resolve/main/shared\\..\\x",
        "/ns/../resolve/main/model-package.json",
        f"/api/models/{REPO}/tree/main/%2e%2e",
    ],
)
def test_server_refuses_unsafe_paths(hub: FaultyHub, path: str) -> None:
    status, _, _ = _request(hub, "GET", path)
    assert status == 400


def test_server_refuses_to_serve_symlinks_out_of_the_package(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"s")
    pkg = write_tree(tmp_path / "pkg", {"model-package.json": b"{}"})
    os.symlink(tmp_path / "secret", pkg / "leak")
    with pytest.raises(ValueError, match="refusing to serve"), FaultyHub() as hub:
        hub.add_revision(REPO, pkg)


def test_faults_and_counters(hub: FaultyHub, tmp_path: Path) -> None:
    path = "layers/layer-00000.gguf"
    url_path = f"/{REPO}/resolve/main/{path}"
    hub.inject(REPO, path, Fault.NOT_FOUND)
    assert _request(hub, "HEAD", url_path)[0] == 404
    status, headers, _ = _request(hub, "GET", url_path)
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound"

    hub.inject(REPO, path, Fault.SERVER_ERROR)  # default: GET only
    assert _request(hub, "HEAD", url_path)[0] == 200
    assert _request(hub, "GET", url_path)[0] == 500

    hub.inject(REPO, path, Fault.SERVER_ERROR, methods=["GET"], times=1)
    assert _request(hub, "GET", url_path)[0] == 500
    assert _request(hub, "GET", url_path)[0] == 200  # one-shot fault cleared itself

    data = FILES_V1[path]
    hub.inject(REPO, path, Fault.FLIP_BYTE)
    status, _, body = _request(hub, "GET", url_path)
    assert status == 200 and len(body) == len(data) and body != data
    assert sum(a != b for a, b in zip(body, data, strict=True)) == 1

    hub.inject(REPO, path, Fault.TRUNCATE)
    status, headers, body = _request(hub, "GET", url_path)
    assert body == data[: len(data) // 2] and headers["X-Linked-Size"] == str(len(data))

    hub.inject(REPO, None, Fault.SERVER_ERROR)  # repo-level JSON API
    with pytest.raises(HfHubHTTPError) as info:
        HfApi(endpoint=hub.url).model_info(REPO)
    assert info.value.response.status_code == 500

    stats = hub.stats(REPO, path)
    assert (stats.head_requests, stats.get_requests) == (2, 6)
    assert stats.bytes_served == len(data) + len(data) + len(data) // 2
    assert hub.downloaded_paths(REPO) == {path}

    hub.reset()
    assert hub.get_count(REPO, path) == 0 and hub.request_log() == []
    assert _request(hub, "GET", url_path)[2] == data
    assert hub.get_count(REPO, path) == 1


def test_stop_cuts_keepalive_connections(tmp_path: Path) -> None:
    """A stopped hub must not keep answering through the client's pooled connection."""
    hub = FaultyHub()
    hub.add_revision(REPO, write_tree(tmp_path / "v1", FILES_V1))
    hub.start()
    api = HfApi(endpoint=hub.url)
    api.model_info(REPO)
    hub.stop()
    with pytest.raises(httpx2.TransportError):
        api.model_info(REPO)


def test_subprocess_mode(tmp_path: Path) -> None:
    v1 = write_tree(tmp_path / "v1", FILES_V1)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mesh_node.lab.hub_server",
            "--repo",
            f"{REPO}={v1}@dev",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        info = HfApi(endpoint=url).model_info(REPO, revision="dev")
        assert info.sha is not None and len(info.sha) == 40
        with pytest.raises(RevisionNotFoundError):
            HfApi(endpoint=url).model_info(REPO, revision="main")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0
