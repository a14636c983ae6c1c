"""``mesh-node``: keys, owner certificates, running a node, asking it for status or a topology.

Same conventions as ``skippy-model-package``: exit codes 0 ok / 1 invalid / 2 bad usage or
unreadable input, stable error codes, ``--json`` (one document on stdout), no tracebacks for
user errors. Heavy imports (trio, the node) happen only in the commands that need them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from skippy.errors import EXIT_OK, EXIT_USAGE, Interrupted, SkippyError, UsageError

PROG = "mesh-node"
STATUS_TIMEOUT_S = 5.0
TOPOLOGY_TIMEOUT_S = 120.0
SPECULATIVE_HELP = (
    "speculative decoding: auto (the package's default), disabled, ngram-cache or ngram-suffix "
    "(any package: request-local drafts, verified exactly), mtp, or a strategy id the package "
    "declares"
)


class _LineFormatter(logging.Formatter):
    """One structured line per record: ``ts=... level=... logger=... msg="..."``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        line = (
            f"ts={ts}.{int(record.msecs):03d} level={record.levelname} logger={record.name} "
            f"msg={json.dumps(record.getMessage())}"
        )
        if record.exc_info:  # only for our own bugs (a handler crash), never user errors
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


@dataclass
class CommandResult:
    # Not skippy.commands.output's: importing skippy.commands loads every package command
    # (~0.27 s), which `mesh-node status` must not pay.
    data: dict[str, Any]
    text: str
    exit_code: int = EXIT_OK
    printed: bool = False  # the command printed its document itself (the lab, once ready)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors exit 2 with our code (as JSON under --json)."""

    json_errors = False

    def error(self, message: str) -> Any:
        if _Parser.json_errors:
            print(json.dumps({"ok": False, "error": {"code": "usage", "message": message}}))
        else:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


# --- commands ------------------------------------------------------------------------------
def cmd_keygen(args: argparse.Namespace) -> CommandResult:
    from mesh_node.identity import node_id_of, write_private_key

    node_id = node_id_of(write_private_key(Path(args.path)))
    return CommandResult({"ok": True, "node_id": node_id, "path": args.path}, node_id)


def cmd_id(args: argparse.Namespace) -> CommandResult:
    from mesh_node.identity import load_private_key, node_id_of

    node_id = node_id_of(load_private_key(Path(args.path)))
    return CommandResult({"ok": True, "node_id": node_id, "path": args.path}, node_id)


def cmd_devices(args: argparse.Namespace) -> CommandResult:
    from skippy.gguf import ggml
    from skippy.runtime.devices import list_devices

    devices = list_devices(ggml.load())
    mib = 2**20
    lines = [f"{'NAME':<12} {'TYPE':<6} {'FREE MiB':>10} {'TOTAL MiB':>10}  DESCRIPTION"]
    lines += [
        f"{d.name:<12} {d.kind:<6} {d.free_bytes // mib:>10} {d.total_bytes // mib:>10}  "
        f"{d.description}"
        for d in devices
    ]
    data = {"ok": True, "devices": [d.to_dict() for d in devices]}
    return CommandResult(data, "\n".join(lines))


def cmd_owner_init(args: argparse.Namespace) -> CommandResult:
    from mesh_node.identity import node_id_of, write_private_key

    owner_id = node_id_of(write_private_key(Path(args.path)))
    return CommandResult({"ok": True, "owner_id": owner_id, "path": args.path}, owner_id)


def cmd_owner_sign(args: argparse.Namespace) -> CommandResult:
    from mesh_node.identity import issue_certificate, load_private_key, write_certificate

    owner = load_private_key(Path(args.owner))
    cert = issue_certificate(owner, args.node_id, days=args.days)
    write_certificate(Path(args.out), cert)
    data = {"ok": True, "certificate": cert.to_dict(), "path": args.out}
    text = f"certified node {args.node_id} for owner {cert.owner_id.hex()} -> {args.out}"
    return CommandResult(data, text)


def cmd_invite(args: argparse.Namespace) -> CommandResult:
    import time

    from mesh_node.identity import load_local_identity, load_private_key
    from mesh_node.invites import invite_for, issue_token, parse_ttl
    from mesh_node.settings import load_node_settings, parse_host_port

    ttl_s = parse_ttl(args.ttl)
    config = _existing_config(args)
    settings = load_node_settings(config)
    identity = load_local_identity(settings.identity_path, settings.certificate_path)
    owner_path = Path(args.owner) if args.owner else config.parent / "owner.key"
    owner = load_private_key(owner_path)
    addresses = (
        [parse_host_port(a, "--address") for a in args.address]
        if args.address
        else [settings.listen]
    )
    invite = invite_for(identity, owner, addresses, ttl_s=ttl_s, now_s=time.time())
    token = issue_token(invite, owner)
    if not args.json:  # stdout is the token alone, for a pipe; the rest is for the operator
        import datetime

        until = datetime.datetime.fromtimestamp(invite.expires_s, datetime.UTC)
        sys.stderr.write(
            f"invite to the mesh of owner fingerprint {invite.fingerprint}, valid until "
            f"{until:%Y-%m-%d %H:%M:%S} UTC; joiners dial "
            f"{', '.join(a.url for a in invite.addresses)}\n"
        )
    data = {"ok": True, "token": token, **invite.to_dict()}
    return CommandResult(data, token)


def _joining(args: argparse.Namespace, settings: Any, identity: Any) -> Any:
    """``settings`` with ``--join``'s nodes as configured peers (refused: nothing written)."""
    if getattr(args, "join", None) is None:
        return settings
    import time

    from mesh_node.invites import settings_joining

    joined = settings_joining(settings, identity, args.join, time.time())
    added = [str(p) for p in joined.peers if p not in settings.peers]
    sys.stderr.write(f"joining through the invite: dialing {', '.join(added)}\n")
    return joined


def _check_join_before_first_run(args: argparse.Namespace) -> None:
    """``serve --join`` without ``--config``: the invite is checked against the owner key the
    data directory holds before the first run creates anything there."""
    if args.join is None or args.config is not None:
        return
    import time

    from mesh_node.first_run import OWNER_KEY_NAME
    from mesh_node.identity import load_private_key, node_id_of
    from mesh_node.invites import check_join_for_owner

    owner_path = _default_data_dir(args).expanduser() / OWNER_KEY_NAME
    owner = node_id_of(load_private_key(owner_path)) if owner_path.exists() else None
    check_join_for_owner(args.join, owner, time.time())


def _default_data_dir(args: argparse.Namespace) -> Path:
    from skippy.config import read_environment

    data_dir = getattr(args, "data_dir", None)
    return Path(data_dir) if data_dir else read_environment().node_data_dir


def _serve_config(args: argparse.Namespace) -> Path:
    """``--config``, or without it the node of the data directory (``--data-dir``, default
    XDG's), created there on first use; what was created or reused is said on stderr."""
    if args.config is not None:
        if args.data_dir is not None:
            raise UsageError(
                "--data-dir is for serving without --config (the config's data_dir decides)",
                code="usage",
            )
        return Path(args.config)
    from mesh_node.first_run import prepare_default_node

    node = prepare_default_node(_default_data_dir(args))
    for note in node.notes:
        sys.stderr.write(f"{note}\n")
    return node.config_path


def _existing_config(args: argparse.Namespace) -> Path:
    """``--config``, or the node.toml that `mesh-node serve` without --config created."""
    from mesh_node.settings import NODE_TOML_NAME

    if args.config is not None:
        return Path(args.config)
    path = _default_data_dir(args) / NODE_TOML_NAME
    if not path.is_file():
        raise UsageError(
            f"no --config given, and {path} does not exist",
            code="usage",
            path=str(path),
            remediation="pass --config node.toml (or --data-dir of a `mesh-node serve` without "
            "--config)",
        )
    return path


def _check_devices(runtime: Any) -> None:
    """The configured device and placement rules name devices this ggml has (ggml is loaded
    only when they name one)."""
    if runtime.device.upper() in ("AUTO", "CPU") and not runtime.placement:
        return
    from skippy.gguf import ggml
    from skippy.runtime.devices import check_configured, list_devices

    check_configured(list_devices(ggml.load()), runtime.device, runtime.placement)


def _node_settings(args: argparse.Namespace, config: Path | None = None) -> tuple[Any, Any]:
    """The node's settings with the command line's --http/--http-public/--listen applied, its
    identity; warnings printed."""
    from mesh_node.identity import load_local_identity
    from mesh_node.settings import load_node_settings, parse_host_port, parse_http_bind

    settings = load_node_settings(config if config is not None else Path(args.config))
    if getattr(args, "listen", None) is not None:
        settings = replace(settings, listen=parse_host_port(args.listen, "--listen"))
    if args.http is not None or args.http_public:
        settings = replace(
            settings,
            http=parse_http_bind(args.http, "--http") if args.http is not None else settings.http,
            http_public=settings.http_public or args.http_public,
        )
    if args.api_key_file is not None:
        settings = replace(
            settings,
            http_settings=replace(
                # absolute, not resolved: a symbolic link is refused, not followed
                settings.http_settings, api_key_file=Path(os.path.abspath(args.api_key_file))
            ),
        )
    if getattr(args, "device", None) is not None:
        from skippy.config import runtime_settings

        device = runtime_settings({}, args.device).device  # checked as the file's would be
        settings = replace(settings, runtime=replace(settings.runtime, device=device))
    if hasattr(args, "device"):  # run and serve: a device that is not there, refused now
        _check_devices(settings.runtime)
    identity = load_local_identity(settings.identity_path, settings.certificate_path)
    warnings = list(settings.warnings)
    if settings.http is not None:
        from mesh_node.http.bind import check_http_bind
        from mesh_node.http.keys import load_api_keys

        # Refused before the node starts; the node's own start (the one gate) warns.
        keys = load_api_keys(settings.http_settings)
        check_http_bind(settings.http, settings.http_public, authenticated=keys.required)
    for warning in warnings:
        sys.stderr.write(f"warning: {warning}\n")
    return settings, identity


def cmd_run(args: argparse.Namespace) -> CommandResult:
    from mesh_node.allocator import tune_for_streaming
    from mesh_node.node_process import run_node

    settings, identity = _node_settings(args)
    settings = _joining(args, settings, identity)
    tune_for_streaming()  # links and artifact transfers: see mesh_node/allocator.py
    _run_trio(run_node, settings, identity)
    return CommandResult({"ok": True}, "")


def cmd_serve(args: argparse.Namespace) -> CommandResult:
    from mesh_node.node_process import run_node
    from mesh_node.serving.split_service import ServeOptions
    from skippy.serving.replicas import check_replicas

    if args.stages is not None and args.stages < 1:
        raise UsageError("--stages must be at least 1", code="usage")
    _check_join_before_first_run(args)
    config = _serve_config(args)
    settings, identity = _node_settings(args, config)
    settings = _joining(args, settings, identity)
    if args.config is None and _is_loopback(settings.listen.host):
        sys.stderr.write(
            f"peers may join on {settings.listen} (loopback: this machine only); "
            "--listen 0.0.0.0:PORT lets other machines join\n"
        )
    assert settings.http is not None  # --http has a default (typing)
    replicas = args.replicas if args.replicas is not None else settings.serving.replicas
    check_replicas(replicas, args.stages)
    from mesh_node.settings import read_node_config

    options = ServeOptions(
        package=args.package,
        stages=args.stages,
        http=settings.http,
        model_name=args.model_name,
        # [speculative] and model entries of the same config, and the CLI's choice
        speculative=read_node_config(config).speculative,
        speculative_strategy=args.speculative_strategy,
        replicas=args.replicas,
    )

    async def main() -> None:
        await run_node(settings, identity, serve=options)

    _run_trio(main)
    return CommandResult({"ok": True}, "")


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _run_trio(fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run``, with our error surfacing from inside a nursery raised as itself (the
    CLI prints its code and message, never an exception group's traceback). A Ctrl-C that
    landed in a nursery comes out as ``KeyboardInterrupt`` first: the user asked to stop,
    whatever else failed meanwhile (``main`` exits 130)."""
    import trio

    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        from mesh_node.errors import surfaced

        found = surfaced(group)
        if found is None:
            raise
        raise found from None


def cmd_status(args: argparse.Namespace) -> CommandResult:
    import trio

    from mesh_node import control
    from mesh_node.peers import render_status
    from mesh_node.settings import load_node_settings

    settings = load_node_settings(_existing_config(args))
    response = trio.run(
        control.request, settings.control_socket, {"op": "status"}, STATUS_TIMEOUT_S
    )
    status = response["status"]
    return CommandResult(status, render_status(status))


def cmd_topology(args: argparse.Namespace) -> CommandResult:
    import trio

    from mesh_node import control
    from mesh_node.settings import load_node_settings

    settings = load_node_settings(Path(args.config))
    if args.replan:
        payload: dict[str, Any] = {"op": "replan"}
    elif args.package is None:
        raise UsageError("topology needs --package REF (or --replan)", code="usage")
    else:
        payload = {
            "op": "topology",
            "package": args.package,
            "stages": args.stages,
            "include_self": not args.workers_only,
        }
        if args.dry_run:
            payload["dry_run"] = True
    response = trio.run(control.request, settings.control_socket, payload, TOPOLOGY_TIMEOUT_S)
    if "plan" in response:
        return _dry_run_result(response["plan"])
    from mesh_node.peers import render_topology

    topo = response["topology"]
    code = 0 if topo["state"] == "active" else 1
    return CommandResult(topo, render_topology(topo), exit_code=code)


def _dry_run_result(plan: dict[str, Any]) -> CommandResult:
    """``topology --dry-run``: the ranked candidates, nothing sent."""
    lines = [f"dry run: {plan['candidates_total']} candidate(s), nothing sent"]
    for c in plan["candidates"][:10]:
        modes = c.get("stage_modes") or [""] * len(c["nodes"])  # with devices: where it sits
        stages = ", ".join(
            f"{n[:12]} {a}..{b}" + (f" ({m})" if m else "")
            for n, (a, b), m in zip(c["nodes"], c["layers"], modes, strict=True)
        )
        fit = "" if c["fits"] else f"  (does not fit: {c['problem']})"
        lines.append(
            f"  {c['predicted_ms_per_token']:8.2f} ms/token (compute {c['compute_ms']:.2f} + "
            f"hops {c['hops_ms']:.2f}): {stages}{fit}"
        )
    lines.append(f"chosen: {plan['why']}")
    lines += [f"  {k}: {v}" for k, v in plan["assumptions"].items()]
    return CommandResult(plan, "\n".join(lines), exit_code=0 if plan["chosen"] else 1)


def _lab_links(args: argparse.Namespace) -> Any:
    """The emulated links from ``--link-*`` and ``--links FILE`` (None: plain
    loopback, no relays)."""
    flags = (args.link_latency, args.link_jitter, args.link_rate, args.link_loss)
    if args.links is None and all(f is None for f in flags):
        return None
    from mesh_node.lab import netem

    default = netem.LinkSpec(
        rtt_s=0.0 if args.link_latency is None else netem.parse_duration(
            args.link_latency, "--link-latency"
        ),
        jitter_s=0.0 if args.link_jitter is None else netem.parse_duration(
            args.link_jitter, "--link-jitter"
        ),
        rate_bytes_per_s=None if args.link_rate is None else netem.parse_rate(
            args.link_rate, "--link-rate"
        ),
        loss=0.0 if args.link_loss is None else netem.parse_probability(
            args.link_loss, "--link-loss"
        ),
    )
    if args.links is None:
        return netem.LinkTable(default)
    return netem.load_lab_file(Path(args.links), default)


def _lab_nat(text: str | None) -> dict[str, str] | None:
    """``--nat [KIND1,KIND2]``: the two homes' NAT kinds (None: no NAT lab)."""
    if text is None:
        return None
    kinds = [k.strip() for k in text.split(",")] if text else []
    if len(kinds) > 2:
        raise UsageError(
            f"--nat takes at most two kinds (home1,home2), not {text!r}", code="usage"
        )
    return dict(zip(("home1", "home2"), kinds, strict=False))


def _lab_home_rate(args: argparse.Namespace) -> int | None:
    """``--home-rate RATE``: each NAT lab home's line, both ways (None: unshaped)."""
    if args.home_rate is None:
        return None
    if args.nat is None:
        raise UsageError("--home-rate shapes the NAT lab's homes: it needs --nat", code="usage")
    from mesh_node.lab import netem

    return int(netem.parse_rate(args.home_rate, "--home-rate"))


def cmd_lab(args: argparse.Namespace) -> CommandResult:
    from mesh_node.lab.report import render_report
    from mesh_node.lab.run import LabOptions, run_lab
    from mesh_node.serving.completion_report import render_prompt_report
    from skippy.config import parse_size

    overrides: dict[int, dict[str, Any]] = {}
    if args.serve_rate is not None:  # the coordinator's uplink cap (artifact_serve_bytes_per_s)
        overrides[0] = {"artifact_serve_bytes_per_s": parse_size(args.serve_rate, "--serve-rate")}
    options = LabOptions(
        nodes=args.nodes,
        package=args.package,
        transfer=args.transfer,
        foreign_owners=args.foreign_owner,
        root=Path(args.dir) if args.dir else None,
        keep=args.keep,
        timeout_s=args.timeout,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        serve=args.serve,
        node_overrides=overrides,
        links=_lab_links(args),
        stages=args.stages,
        revision_change=args.revision_change,
        replicas=args.replicas,
        speculative_strategy=args.speculative_strategy,
        nat=_lab_nat(args.nat),
        nat_home_bytes_per_s=_lab_home_rate(args),
    )
    if options.nat is not None and (args.http is not None or args.serve):
        raise UsageError(
            "--nat does not combine with --http or --serve: the coordinator's page and API "
            "would be on its namespace's loopback (use --prompt)",
            code="usage",
        )

    def render(report: dict[str, Any]) -> str:
        text = render_report(report)
        if report.get("prompt"):
            text += "\n" + render_prompt_report(report["prompt"])
        return text

    if args.http is None and not args.serve:
        report = _run_trio(run_lab, options)
        return CommandResult(report, render(report), exit_code=0 if report["ok"] else 1)
    from mesh_node.lab.page import run_lab_with_page

    # The lab stays up. stdout stays one JSON document under --json (printed when the lab
    # stops), so the addresses go to stderr then.
    out = sys.stderr if args.json else sys.stdout

    def on_page(url: str) -> None:
        out.write(f"status-page {url}\n")
        out.flush()

    printed: list[dict[str, Any]] = []

    def on_report(report: dict[str, Any]) -> None:
        # The report once ready: the one JSON document on stdout under --json
        printed.append(report)
        print(json.dumps(report, indent=2, default=str) if args.json else render(report))
        sys.stdout.flush()
        if report.get("api"):
            out.write(f"api {report['api']}\n")
        out.write("the lab stays up: Ctrl-C (or SIGTERM) stops it\n")
        out.flush()

    http = args.http or "127.0.0.1:0"
    try:
        report = _run_trio(
            lambda: run_lab_with_page(options, http, on_page=on_page, on_report=on_report)
        )
    except SkippyError as err:
        if not printed:
            raise
        # After its report (stdout's one document), the lab's end is told on stderr only
        # (its coordinator exited).
        sys.stderr.write(f"error [{err.code}]: {err.message}\n")
        return CommandResult(printed[0], "", exit_code=err.exit_code, printed=True)
    return CommandResult(report, "", exit_code=0 if report["ok"] else 1, printed=True)


# --- parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run and inspect a skippy mesh node.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(
        name: str,
        handler: Callable[[argparse.Namespace], CommandResult],
        help_: str,
        owner: Any = sub,
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = owner.add_parser(name, help=help_, description=help_)
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        p.set_defaults(handler=handler)
        return p

    add("keygen", cmd_keygen, "create a node key (0600) and print its node id").add_argument("path")
    add("id", cmd_id, "print the node id of a key file").add_argument("path")
    owner = sub.add_parser("owner", help="owner keys and node certificates")
    owner_sub = owner.add_subparsers(dest="owner_command", metavar="COMMAND", parser_class=_Parser)
    owner_sub.required = True
    add(
        "init", cmd_owner_init, "create an owner key and print the owner id", owner_sub
    ).add_argument("path")
    p = add("sign", cmd_owner_sign, "certify that NODE_ID belongs to this owner", owner_sub)
    p.add_argument("--owner", required=True, help="the owner key file")
    p.add_argument("node_id")
    p.add_argument("--out", required=True, help="where to write the certificate")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p = add("run", cmd_run, "run a node until SIGINT/SIGTERM")
    p.add_argument("--config", required=True)
    p.add_argument(
        "--device",
        metavar="NAME",
        help='where this node\'s stage runs: auto, CPU or a device `mesh-node devices` '
        'lists (config: [runtime] device; default auto)',
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve the read-only status page, /api/status and /metrics here; a bare port "
        "means 127.0.0.1 (config: http)",
    )
    p.add_argument(
        "--http-public",
        action="store_true",
        help="allow --http on a non-loopback address (config: http_public)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="HTTP API keys, one per line (0600); every request but /health needs one "
        "(config: [http] api_key_file; env: MESH_NODE_API_KEY)",
    )
    p.add_argument(
        "--join",
        metavar="TOKEN",
        help="an invite (mesh-node invite): check it, then dial its nodes as configured peers",
    )
    p = add(
        "serve",
        cmd_serve,
        "run a node that coordinates a split of PACKAGE (stage 0 here) and serves an "
        "OpenAI-compatible API beside its status page",
    )
    p.add_argument(
        "--config",
        help="the node TOML (default: the node in --data-dir, created there on first run)",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="without --config: where the node's keys, owner certificate and node.toml live, "
        "created on first run (default $XDG_DATA_HOME/mesh-node, else "
        "~/.local/share/mesh-node)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where peers dial this node (config: listen; without --config 127.0.0.1:7000, "
        "this machine only: 0.0.0.0:7000 lets other machines join)",
    )
    p.add_argument(
        "--package",
        required=True,
        help="hf://ns/repo@rev or a package directory (a .gguf file: package it first, "
        "skippy-model-package write)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help="number of stages; waits for that many - 1 capable peers, further peers are "
        "spares (default: all connected, and capable peers that join later grow the split; "
        "a model the stage runtime does not cover is served whole on this node by llama.cpp)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="independent pipelines of the package over disjoint peers, requests balanced "
        "across them (needs --stages S; R x (S - 1) capable peers; default [serving] replicas, 1)",
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        default="127.0.0.1:8080",
        help="the API (/v1) and the status page (default 127.0.0.1:8080)",
    )
    p.add_argument(
        "--http-public",
        action="store_true",
        help="allow --http on a non-loopback address (config: http_public)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="HTTP API keys, one per line (0600); every request but /health needs one "
        "(config: [http] api_key_file; env: MESH_NODE_API_KEY)",
    )
    p.add_argument("--model-name", default=None, help="the model id the API answers to")
    p.add_argument(
        "--join",
        metavar="TOKEN",
        help="an invite (mesh-node invite): check it, then dial its nodes as configured peers",
    )
    p.add_argument(
        "--device",
        metavar="NAME",
        help='where this node\'s stage runs: auto, CPU or a device `mesh-node devices` '
        'lists (config: [runtime] device; default auto)',
    )
    p.add_argument(
        "--speculative-strategy",
        "--speculative",
        metavar="S",
        help=SPECULATIVE_HELP + " (overrides the config's [speculative])",
    )
    p = add(
        "invite",
        cmd_invite,
        "print a signed, expiring invite to this node's mesh (run/serve --join TOKEN uses it)",
    )
    p.add_argument("--config", help="the node TOML (default: the node in --data-dir)")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="without --config: the folder of a `mesh-node serve` without --config",
    )
    p.add_argument(
        "--owner",
        metavar="PATH",
        help="the owner key that certified this node (default: owner.key beside the config)",
    )
    p.add_argument(
        "--ttl", default="24h", help="how long the invite is valid: 30m, 24h, 7d (default 24h)"
    )
    p.add_argument(
        "--address",
        action="append",
        metavar="HOST:PORT",
        help="where joiners dial this node (repeatable; default: its listen address)",
    )
    add("devices", cmd_devices, "list the devices this node's ggml sees (type, free/total memory)")
    p = add("status", cmd_status, "ask the running node for its status")
    p.add_argument("--config", help="the node TOML (default: the node in --data-dir)")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="without --config: the folder of a `mesh-node serve` without --config (default "
        "$XDG_DATA_HOME/mesh-node, else ~/.local/share/mesh-node)",
    )
    p = add(
        "topology",
        cmd_topology,
        "plan a split of PACKAGE over the capable peers, sign it and send it to them",
    )
    p.add_argument("--config", required=True)
    p.add_argument("--package", help="hf://ns/repo@rev or a package directory")
    p.add_argument(
        "--replan",
        action="store_true",
        help="plan the last package again over the peers connected now (same run)",
    )
    p.add_argument("--stages", type=int, default=None, help="number of stages (default: all)")
    p.add_argument(
        "--workers-only",
        action="store_true",
        help="do not place a stage on this (coordinator) node",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="rank every candidate split by predicted decode ms/token (link RTTs, memory) and "
        "print them; send nothing",
    )
    p = add(
        "lab",
        cmd_lab,
        "start N local nodes, split PACKAGE over them, and report which artifacts moved where",
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes to start (>= 2)")
    p.add_argument("--package", required=True, help="a package directory or hf://ns/repo@rev")
    p.add_argument(
        "--transfer",
        choices=["open", "trusted", "disabled"],
        default="trusted",
        help="every node's artifact_transfer mode (default trusted)",
    )
    p.add_argument(
        "--foreign-owner",
        type=int,
        default=0,
        metavar="K",
        help="the last K workers belong to a second owner nobody trusts (default 0)",
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="the coordinator serves its status page here (printed as `status-page URL`); the "
        "lab then stays up after its report until Ctrl-C",
    )
    p.add_argument(
        "--serve-rate",
        metavar="SIZE",
        help="cap the coordinator's artifact serving at SIZE bytes per second (e.g. 20MB; "
        "default unlimited): watch transfers move on the status page, or emulate an uplink",
    )
    p.add_argument("--dir", help="where the nodes live (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the nodes' folders and logs")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for the split to be ready"
    )
    p.add_argument(
        "--prompt",
        help="serve the split (stage 0 on the coordinator) and run one greedy completion",
    )
    p.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate with --prompt (16)"
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="serve the split behind the OpenAI API and keep the lab up (prints the API's and "
        "the status page's addresses) until Ctrl-C",
    )
    p.add_argument(
        "--nat",
        nargs="?",
        const="",
        metavar="KIND1,KIND2",
        help="run the 3 nodes in the NAT lab (root): n0 public, coordinating and relaying; "
        "n1 and n2 in two homes behind NATs of these kinds (masquerade, stealth, full-cone; "
        "default masquerade); the network namespaces are removed on exit",
    )
    p.add_argument(
        "--home-rate",
        metavar="RATE",
        help="with --nat: each home's line, its uplink and its downlink (e.g. 100Mbit; the "
        "kernel's token bucket on the home's router; default unshaped)",
    )
    links = p.add_argument_group(
        "emulated links (every node dials every other through a relay of the lab)"
    )
    links.add_argument(
        "--link-latency",
        metavar="TIME",
        help="round-trip time added to every link, half each way (e.g. 20ms)",
    )
    links.add_argument("--link-jitter", metavar="TIME", help="one-way jitter, +- (e.g. 2ms)")
    links.add_argument(
        "--link-rate", metavar="RATE", help="each direction's rate (e.g. 100Mbit, 1Gbit)"
    )
    links.add_argument(
        "--link-loss",
        metavar="P",
        help="per 64 KiB chunk relayed, the probability the connection drops (e.g. 0.1%%)",
    )
    links.add_argument(
        "--links",
        metavar="FILE",
        help="a TOML lab file with [links] and [[links.pair]] a = I, b = J, latency, jitter, "
        "rate, loss, stall, stall_time (per-pair values; the flags are its defaults)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help="with --serve/--prompt: serve over S stages, the other nodes are spares "
        "(default: one stage per node)",
    )
    p.add_argument(
        "--revision-change",
        type=int,
        default=None,
        metavar="LAYER",
        help="after the split, publish a second revision of the package directory with LAYER "
        "changed and split it too: the report shows what moved (only that layer should)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --serve/--prompt: R pipelines over disjoint workers (R x (S - 1) workers; "
        "default S: an equal share of the workers per replica)",
    )
    p.add_argument(
        "--speculative-strategy",
        "--speculative",
        metavar="S",
        help="with --serve/--prompt: " + SPECULATIVE_HELP + "; the report shows the strategy "
        "and its drafted and accepted tokens",
    )
    return parser


def _version() -> str:
    from skippy import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in args_list
    args = build_parser().parse_args(args_list)
    as_json = bool(getattr(args, "json", False))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter())
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command in ("run", "serve") else logging.WARNING,
        handlers=[handler],
    )
    try:
        result: CommandResult = args.handler(args)
    except SkippyError as err:
        if as_json:
            print(json.dumps({"ok": False, "error": err.to_dict()}, indent=2, default=str))
        else:
            sys.stderr.write(f"error [{err.code}]: {err.message}\n")
            if err.remediation:
                sys.stderr.write(f"hint: {err.remediation}\n")
        return err.exit_code
    except Interrupted as err:  # a signal the command handled: it cleaned up, then said so
        if as_json:
            print(json.dumps({"ok": False, "error": err.to_dict()}, indent=2))
        else:
            sys.stderr.write(f"error [{err.code}]: {err.message}\n")
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except OSError as exc:  # an I/O failure we did not anticipate: still no traceback
        where = f": {exc.filename}" if exc.filename else ""
        err_doc = {"code": "io_error", "message": f"{exc.strerror or exc}{where}"}
        if as_json:
            print(json.dumps({"ok": False, "error": err_doc}))
        else:
            sys.stderr.write(f"error [io_error]: {err_doc['message']}\n")
        return EXIT_USAGE
    try:
        if result.printed:
            pass
        elif as_json:
            print(json.dumps(result.data, indent=2, default=str))
        elif result.text:
            print(result.text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result.exit_code
