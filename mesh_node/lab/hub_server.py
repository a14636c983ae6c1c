"""The lab hub: a local server speaking the Hugging Face Hub's download API.

A lab component (``mesh-node lab`` publishes a package directory on it; the demo, the
benchmarks and the tests use it), and a stand-in for the real Hub, which is not reachable on
the machines this project is built on: it is not the Hub, only the subset of its HTTP API
that ``huggingface_hub`` uses for downloads, served from local disk.

Consumers fetch package files through the real ``huggingface_hub`` client; this module serves
package directories over the part of the API that ``huggingface_hub`` 2.4.0 downloads with:

* ``GET /api/models/{ns}/{name}[/revision/{rev}]``: model_info (``id``, ``sha``, ``siblings``;
  sizes and LFS info only with ``?blobs=true``, as on the Hub).
* ``GET /api/models/{ns}/{name}/tree/{rev}[/{path}]``: tree listing, ``?recursive=``,
  cursor pagination through a ``Link: <...>; rel="next"`` header (what ``paginate`` follows).
* ``HEAD``/``GET /{ns}/{name}/resolve/{rev}/{path}``: file bytes with the metadata headers the
  client needs (``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` = sha256 like an LFS file,
  ``X-Linked-Size``), and ``Range: bytes=a-b``/``a-``/``-n`` answered with 206. No redirect and
  no ``X-Xet-*`` header, so the client downloads over plain HTTP from this server.
* 404s carry ``X-Error-Code`` (``RepoNotFound``/``RevisionNotFound``/``EntryNotFound``) so the
  client raises its typed errors at once.

Every file is presented as an LFS file, so the cache blob is named by its sha256. Revisions are
immutable snapshots of a directory *listing*: the commit sha is the sha1 of the repo id and the
sorted ``(path, size, sha256)`` lines, and bytes are re-read from disk on each request (do not
edit a served directory). Per-file counters and the request log are thread-safe. Fault
injection is test tooling and lives beside the tests (``tests/support/hubfaults.py``); this hub only
offers the two hooks it uses (``_Handler._intercept`` and ``_Handler._presented``, plus
``FakeHub.handler_class``), which answer every request normally here.

In process::

    with FakeHub() as hub:
        commit = hub.add_revision("ns/pkg", package_dir)
        hf_hub_download("ns/pkg", "model-package.json", endpoint=hub.url, cache_dir=...)

As a subprocess: ``python -m mesh_node.lab.hub_server --repo ns/name=DIR[@branch] ... [--port N]``
prints the base URL as the first stdout line and serves until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Final
from urllib.parse import parse_qs, quote, unquote, urlsplit

COMMIT_RE: Final = re.compile(r"^[0-9a-f]{40}$")
LFS_POINTER_SIZE: Final = 134  # a real LFS pointer file is ~130 bytes; the client only stores it
FIXED_DATE: Final = "2026-01-01T00:00:00.000Z"
_READ_CHUNK: Final = 1 << 20


@dataclass(frozen=True)
class HubFile:
    """One file of one revision; bytes stay on disk."""

    path: str
    source: Path
    size: int
    sha256: str
    git_oid: str


@dataclass(frozen=True)
class Revision:
    commit: str
    files: Mapping[str, HubFile]

    def directories(self) -> list[str]:
        dirs: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        return sorted(dirs)


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, Revision] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Revision | None:
        commit = self.branches.get(revision) or self.tags.get(revision)
        if commit is None and COMMIT_RE.match(revision):
            commit = revision
        return self.commits.get(commit) if commit is not None else None


@dataclass
class FileStats:
    """Requests seen for one (repo_id, path) on the resolve endpoint."""

    get_requests: int = 0
    head_requests: int = 0
    bytes_served: int = 0


class UnsafeRequestPath(ValueError):
    """A URL path component is empty, '.', '..', absolute or contains a separator or NUL."""


def _check_components(parts: Sequence[str]) -> list[str]:
    """Refuse decoded path components that could step outside a repo or name nothing."""
    for part in parts:
        if part in ("", ".", "..") or "\\" in part or "\x00" in part or "/" in part:
            raise UnsafeRequestPath(part)
    return list(parts)


def _safe_segments(raw_segments: Sequence[str]) -> list[str]:
    """Percent-decode URL path segments (each must stay one component)."""
    return _check_components([unquote(raw) for raw in raw_segments])


def _scan_directory(root: Path) -> dict[str, HubFile]:
    """Every regular file under ``root`` keyed by its posix relative path, hashed once."""
    root = root.resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"not a directory: {root}")
    files: dict[str, HubFile] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            source = Path(dirpath) / filename
            real = source.resolve()
            if not real.is_relative_to(root) or not real.is_file():
                raise ValueError(f"refusing to serve {source}: not a regular file inside {root}")
            rel = source.relative_to(root).as_posix()
            sha = hashlib.sha256()
            size = 0
            with real.open("rb") as fh:
                while chunk := fh.read(_READ_CHUNK):
                    sha.update(chunk)
                    size += len(chunk)
            git = hashlib.sha1(f"blob {size}\0".encode())  # git blob oid, as in a real tree
            with real.open("rb") as fh:
                while chunk := fh.read(_READ_CHUNK):
                    git.update(chunk)
            files[rel] = HubFile(rel, real, size, sha.hexdigest(), git.hexdigest())
    return files


def _commit_for(repo_id: str, files: Mapping[str, HubFile]) -> str:
    listing = "".join(
        f"{f.path}\t{f.size}\t{f.sha256}\n" for f in sorted(files.values(), key=lambda f: f.path)
    )
    return hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(start, stop) for a single satisfiable byte range, None to serve it all, "unsatisfiable"."""
    if header is None:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or (not m.group(1) and not m.group(2)):
        return None  # multi-range or garbage: a server may ignore Range and send 200
    first, last = m.group(1), m.group(2)
    if not first:  # suffix range: last N bytes
        n = int(last)
        if n == 0:
            return "unsatisfiable"
        return max(0, size - n), size
    start = int(first)
    stop = size if not last else min(size, int(last) + 1)
    if start >= size or stop <= start:
        return "unsatisfiable"
    return start, stop


class FakeHub:
    """A threaded HTTP server speaking the Hub download API; see the module docstring."""

    handler_class: type[_Handler]  # set below the handler; a test hub may substitute its own

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, tree_page_size: int = 1000
    ) -> None:
        self._host = host
        self._port = port
        self.tree_page_size = tree_page_size
        self._lock = threading.Lock()
        self._repos: dict[str, Repo] = {}
        self._stats: dict[tuple[str, str], FileStats] = {}
        self._log: list[tuple[str, str, int]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # --- content -------------------------------------------------------------------------------
    def add_revision(
        self,
        repo_id: str,
        directory: Path | str,
        *,
        branches: Iterable[str] = ("main",),
        tags: Iterable[str] = (),
    ) -> str:
        """Snapshot ``directory``'s listing as a commit of ``repo_id``; point refs at it."""
        files = _scan_directory(Path(directory))
        commit = _commit_for(repo_id, files)
        with self._lock:
            repo = self._repos.setdefault(repo_id, Repo(repo_id))
            repo.commits.setdefault(commit, Revision(commit, files))
            for branch in branches:
                repo.branches[branch] = commit
            for tag in tags:
                repo.tags[tag] = commit
        return commit

    def commit_of(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            rev = self._repos[repo_id].resolve(revision)
        if rev is None:
            raise KeyError(f"{repo_id} has no revision {revision!r}")
        return rev.commit

    # --- counters ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget counters and the request log (content and refs stay)."""
        with self._lock:
            self._stats.clear()
            self._log.clear()

    def stats(self, repo_id: str, path: str) -> FileStats:
        """A copy of the counters for one file (zeros if never requested)."""
        with self._lock:
            s = self._stats.get((repo_id, path), FileStats())
            return FileStats(s.get_requests, s.head_requests, s.bytes_served)

    def get_count(self, repo_id: str, path: str) -> int:
        return self.stats(repo_id, path).get_requests

    def bytes_served(self, repo_id: str, path: str) -> int:
        return self.stats(repo_id, path).bytes_served

    def downloaded_paths(self, repo_id: str) -> set[str]:
        """Paths of ``repo_id`` that got at least one GET on the resolve endpoint."""
        with self._lock:
            return {p for (r, p), s in self._stats.items() if r == repo_id and s.get_requests}

    def request_log(self) -> list[tuple[str, str, int]]:
        """Every request as (method, raw path, status), oldest first."""
        with self._lock:
            return list(self._log)

    def _count_request(self, repo_id: str, path: str, method: str) -> None:
        with self._lock:
            s = self._stats.setdefault((repo_id, path), FileStats())
            if method == "GET":
                s.get_requests += 1
            else:
                s.head_requests += 1

    def _count_bytes(self, repo_id: str, path: str, nbytes: int) -> None:
        # Called before the bytes are written, so a client that has them sees them counted.
        with self._lock:
            self._stats.setdefault((repo_id, path), FileStats()).bytes_served += nbytes

    def _record(self, method: str, raw_path: str, status: int) -> None:
        with self._lock:
            self._log.append((method, raw_path, status))

    def _lookup(self, repo_id: str, revision: str | None) -> tuple[Repo | None, Revision | None]:
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                return None, None
            return repo, repo.resolve(revision if revision is not None else "main")

    # --- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeHub is not running; call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> str:
        """Bind (ephemeral port by default), serve in a daemon thread, return the base URL."""
        if self._server is not None:
            return self.url
        handler = type("_BoundHandler", (self.handler_class,), {"hub": self})
        self._server = ThreadingHTTPServer((self._host, self._port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop listening and cut open keep-alive connections, so a stopped hub really is gone."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean; FakeHub.request_log() records requests

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    # --- plumbing ------------------------------------------------------------------------------
    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.hub._record(self.command, self.path, status)  # before the client can see it
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: object, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _error(
        self, status: int, error_code: str | None, message: str, commit: str | None = None
    ) -> None:
        headers = {"X-Error-Message": message}
        if error_code is not None:
            headers["X-Error-Code"] = error_code
        if commit is not None:
            headers["X-Repo-Commit"] = commit
        self._json(status, {"error": message}, headers)

    # --- hooks (test tooling overrides them: tests/support/hubfaults.py) -----------------------
    def _intercept(
        self, method: str, repo_id: str, path: str | None, commit: str | None
    ) -> bool:
        """Called before a request is answered (``path=None``: the repo's JSON API; ``commit``:
        the resolved revision of a file request); True when it answered the request itself.
        The plain hub never does."""
        return False

    def _presented(
        self, method: str, repo_id: str, path: str, entry: HubFile
    ) -> tuple[int, int | None]:
        """The representation served for ``entry``: its size and a byte index to corrupt (XOR
        0xFF), or None. The plain hub serves the file as it is."""
        return entry.size, None

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        raw = split.path.split("/")[1:]
        try:
            if len(raw) >= 3 and raw[0] == "api" and raw[1] == "models":
                self._api(method, raw[2:], query)
            elif len(raw) >= 5 and raw[2] == "resolve":
                repo_id = "/".join(_safe_segments(raw[:2]))
                revision = unquote(raw[3])
                self._resolve(method, repo_id, revision, _safe_segments(raw[4:]))
            else:
                self._error(404, None, f"no route for {split.path}")
        except UnsafeRequestPath as exc:
            self._error(400, None, f"unsafe path component {exc.args[0]!r}")

    # --- JSON API ------------------------------------------------------------------------------
    def _api(self, method: str, raw: list[str], query: dict[str, list[str]]) -> None:
        if method != "GET" or len(raw) < 2:
            self._error(404, None, "no such API route")
            return
        repo_id = "/".join(_safe_segments(raw[:2]))
        rest = raw[2:]
        if self._intercept(method, repo_id, None, None):
            return
        if not rest:
            self._model_info(repo_id, None, query)
        elif rest[0] == "revision" and len(rest) == 2:
            self._model_info(repo_id, unquote(rest[1]), query)
        elif rest[0] == "tree" and len(rest) >= 2:
            self._tree(repo_id, unquote(rest[1]), rest[2:], query)
        else:
            self._error(404, None, "no such API route")

    def _revision_or_error(self, repo_id: str, revision: str | None) -> Revision | None:
        repo, rev = self.hub._lookup(repo_id, revision)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if rev is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + str(revision))
            return None
        return rev

    def _model_info(self, repo_id: str, revision: str | None, query: dict[str, list[str]]) -> None:
        rev = self._revision_or_error(repo_id, revision)
        if rev is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings: list[dict[str, object]] = []
        for f in sorted(rev.files.values(), key=lambda f: f.path):
            sib: dict[str, object] = {"rfilename": f.path}
            if blobs:
                sib.update(
                    size=f.size,
                    blobId=f.git_oid,
                    lfs={"size": f.size, "sha256": f.sha256, "pointerSize": LFS_POINTER_SIZE},
                )
            siblings.append(sib)
        self._json(
            200,
            {
                "_id": rev.commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": rev.commit,
                "lastModified": FIXED_DATE,
                "createdAt": FIXED_DATE,
                "private": False,
                "gated": False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            },
        )

    def _tree(
        self, repo_id: str, revision: str, raw_path: list[str], query: dict[str, list[str]]
    ) -> None:
        rev = self._revision_or_error(repo_id, revision)
        if rev is None:
            return
        # huggingface_hub sends the folder as one %2F-encoded segment; plain '/' works too.
        prefix = "/".join(
            _check_components([s for part in raw_path for s in unquote(part).split("/")])
        )
        dirs = rev.directories()
        if prefix and prefix not in dirs:
            self._error(404, "EntryNotFound", f"{prefix} does not exist on {revision}", rev.commit)
            return
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        base = f"{prefix}/" if prefix else ""

        def wanted(path: str) -> bool:
            return path.startswith(base) and (recursive or "/" not in path[len(base) :])

        entries: list[dict[str, object]] = [
            {
                "type": "directory",
                "oid": hashlib.sha1(f"tree {rev.commit} {d}".encode()).hexdigest(),
                "path": d,
            }
            for d in dirs
            if d != prefix and wanted(d)
        ]
        entries += [
            {
                "type": "file",
                "oid": f.git_oid,
                "size": f.size,
                "path": f.path,
                "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": LFS_POINTER_SIZE},
            }
            for f in rev.files.values()
            if wanted(f.path)
        ]
        entries.sort(key=lambda e: str(e["path"]))
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.hub.tree_page_size]
        headers: dict[str, str] = {}
        if start + self.hub.tree_page_size < len(entries):
            split = urlsplit(self.path)
            params = "&".join(
                f"{quote(k)}={quote(v)}" for k, vs in query.items() if k != "cursor" for v in vs
            )
            sep = "&" if params else ""
            nxt = (
                f"{self.hub.url}{split.path}?{params}{sep}cursor={start + self.hub.tree_page_size}"
            )
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(200, page, headers)

    # --- file bytes ----------------------------------------------------------------------------
    def _resolve(self, method: str, repo_id: str, revision: str, segments: list[str]) -> None:
        path = "/".join(segments)
        self.hub._count_request(repo_id, path, method)
        rev = self._revision_or_error(repo_id, revision)
        if rev is None:
            return
        entry = rev.files.get(path)
        if self._intercept(method, repo_id, path, rev.commit):
            return
        if entry is None:
            self._error(404, "EntryNotFound", f"{path} does not exist on {revision}", rev.commit)
            return
        meta = {
            "X-Repo-Commit": rev.commit,
            "ETag": f'"{entry.sha256}"',
            "X-Linked-Etag": f'"{entry.sha256}"',
            "X-Linked-Size": str(entry.size),
            "Accept-Ranges": "bytes",
        }
        size, flip_at = self._presented(method, repo_id, path, entry)
        rng = _parse_range(self.headers.get("Range"), size)
        if rng == "unsatisfiable":
            self._send(416, b"", {**meta, "Content-Range": f"bytes */{size}"})
            return
        status, (start, stop) = (206, rng) if isinstance(rng, tuple) else (200, (0, size))
        headers = dict(meta)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(stop - start))
        for key, value in headers.items():
            self.send_header(key, value)
        self.hub._record(method, self.path, status)
        self.end_headers()
        if method == "GET":
            self._stream((repo_id, path), entry.source, start, stop, flip_at)

    def _stream(
        self, key: tuple[str, str], source: Path, start: int, stop: int, flip_at: int | None
    ) -> None:
        with source.open("rb") as fh:
            fh.seek(start)
            pos = start
            while pos < stop:
                chunk = bytearray(fh.read(min(_READ_CHUNK, stop - pos)))
                if not chunk:
                    break  # file shrank under us; the client's size check will notice
                if flip_at is not None and pos <= flip_at < pos + len(chunk):
                    chunk[flip_at - pos] ^= 0xFF
                self.hub._count_bytes(*key, len(chunk))
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.hub._count_bytes(*key, -len(chunk))  # not all of it left; roughly
                    break
                pos += len(chunk)


FakeHub.handler_class = _Handler


# --- helpers for tests ------------------------------------------------------------------------
def write_tree(root: Path, files: Mapping[str, bytes]) -> Path:
    """Write ``{relative posix path: bytes}`` under ``root`` (created); return ``root``."""
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


@contextlib.contextmanager
def running_hub(
    repos: Mapping[str, Path | Sequence[Path]] | None = None,
    *,
    tree_page_size: int = 1000,
    hub_class: type[FakeHub] = FakeHub,
) -> Iterator[FakeHub]:
    """A started hub (``hub_class``) serving ``{repo_id: dir or [older dirs..., main dir]}``.

    With a list, every directory becomes a commit and ``main`` ends on the last one.
    """
    hub = hub_class(tree_page_size=tree_page_size)
    for repo_id, dirs in (repos or {}).items():
        for directory in [dirs] if isinstance(dirs, Path) else dirs:
            hub.add_revision(repo_id, directory)
    with hub:
        yield hub


def _parse_repo_arg(text: str) -> tuple[str, Path, str]:
    repo_id, sep, rest = text.partition("=")
    if not sep or repo_id.count("/") != 1:
        raise argparse.ArgumentTypeError(f"expected ns/name=DIR[@branch], got {text!r}")
    directory, at, branch = rest.rpartition("@")
    if not at:
        directory, branch = rest, "main"
    return repo_id, Path(directory), branch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--repo",
        action="append",
        type=_parse_repo_arg,
        default=[],
        metavar="NS/NAME=DIR[@BRANCH]",
        help="serve DIR as a commit of NS/NAME on BRANCH (default main); repeatable",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    hub = FakeHub(host=args.host, port=args.port)
    for repo_id, directory, branch in args.repo:
        commit = hub.add_revision(repo_id, directory, branches=(branch,))
        print(f"{repo_id}@{branch} -> {commit}", file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with hub:
        print(hub.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
