"""The node `mesh-node serve` makes in a data directory when it has no --config
(mesh_node.first_run): created once with the identity code's own writers, then reused."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from mesh_node.errors import KeyFilePermissions
from mesh_node.first_run import prepare_default_node
from mesh_node.identity import (
    issue_certificate,
    load_certificate,
    load_local_identity,
    load_private_key,
    write_certificate,
    write_private_key,
)
from mesh_node.settings import load_node_settings
from skippy.errors import UsageError

FILES = ("node.key", "owner.key", "node.cert", "node.toml")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_dir_gets_a_certified_node_and_a_config_the_one_reader_reads(tmp_path):
    data = tmp_path / "a" / "mesh-node"
    node = prepare_default_node(data)
    assert node.created and _mode(data) == 0o700
    assert all(_mode(data / name) == 0o600 for name in FILES)
    assert [n.split()[1] for n in node.notes] == ["node", "owner", "this", str(data / "node.toml")]
    settings = load_node_settings(node.config_path)
    assert settings.data_dir == data.resolve()
    identity = load_local_identity(settings.identity_path, settings.certificate_path)
    assert identity.node_id == node.node_id
    assert identity.owner(time.time()) == (node.owner_id, "verified")


def test_a_second_run_reuses_everything_and_says_so(tmp_path):
    first = prepare_default_node(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in FILES}
    second = prepare_default_node(tmp_path)
    assert not second.created
    assert (second.node_id, second.owner_id) == (first.node_id, first.owner_id)
    assert {name: (tmp_path / name).read_bytes() for name in FILES} == before
    assert len(second.notes) == 1 and second.notes[0].startswith(f"using the node in {tmp_path}")


def test_an_expired_certificate_of_its_own_owner_is_renewed(tmp_path):
    node = prepare_default_node(tmp_path)
    owner = load_private_key(tmp_path / "owner.key")
    old = issue_certificate(owner, node.node_id, days=1, now_s=time.time() - 3 * 86400)
    write_certificate(tmp_path / "node.cert", old, replace=True)
    again = prepare_default_node(tmp_path)
    assert again.created and "renewed: the certificate is expired" in again.notes[0]
    cert = load_certificate(tmp_path / "node.cert")
    assert cert.status_for(bytes.fromhex(node.node_id), time.time())[0] == "verified"


def test_a_certificate_of_another_owner_is_left_alone(tmp_path):
    node = prepare_default_node(tmp_path)
    other = write_private_key(tmp_path / "other-owner.key")
    mine = issue_certificate(other, node.node_id, days=30)
    write_certificate(tmp_path / "node.cert", mine, replace=True)
    before = (tmp_path / "node.cert").read_bytes()
    assert not prepare_default_node(tmp_path).created
    assert (tmp_path / "node.cert").read_bytes() == before


def test_unusable_data_dirs_and_readable_keys_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as err:
        prepare_default_node(tmp_path / "file")
    assert err.value.code == "data_dir_not_a_directory"
    prepare_default_node(tmp_path / "d")
    (tmp_path / "d" / "node.key").chmod(0o644)
    with pytest.raises(KeyFilePermissions):
        prepare_default_node(tmp_path / "d")


def test_cli_data_dir_goes_with_no_config_and_status_names_the_missing_node(tmp_path, capsys):
    from mesh_node.cli import main

    code = main(["serve", "--config", "x.toml", "--data-dir", str(tmp_path), "--package", "p"])
    assert code == 2 and "--data-dir is for serving without --config" in capsys.readouterr().err
    code = main(["status", "--data-dir", str(tmp_path / "none"), "--json"])
    out = capsys.readouterr().out
    assert code == 2 and '"code": "usage"' in out and str(tmp_path / "none" / "node.toml") in out
