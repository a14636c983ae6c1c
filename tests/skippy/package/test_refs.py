"""Package references: (input, parsed, canonical) tables, round trips and rejections."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy.errors import EXIT_USAGE, UsageError
from skippy.package.refs import (
    ACCEPTED_FORMS,
    HfPackageRef,
    InvalidPackageRef,
    LocalPackageRef,
    parse_hf_package_ref,
    parse_package_ref,
)

SHA = "0123456789abcdef0123456789abcdef01234567"
SPEC_REPO = "meshllm/Qwen3-235B-A22B-UD-Q4_K_XL-layers"

# (input, repo_id, revision, canonical)
ACCEPTED = [
    # the three spellings from the spec
    (f"hf://{SPEC_REPO}", SPEC_REPO, None, f"hf://{SPEC_REPO}"),
    (f"hf://{SPEC_REPO}:8f4c2d1", SPEC_REPO, "8f4c2d1", f"hf://{SPEC_REPO}@8f4c2d1"),
    (f"hf://{SPEC_REPO}@main", SPEC_REPO, "main", f"hf://{SPEC_REPO}@main"),
    (f"hf://ns/name@{SHA}", "ns/name", SHA, f"hf://ns/name@{SHA}"),
    (f"hf://ns/name:{SHA}", "ns/name", SHA, f"hf://ns/name@{SHA}"),
    ("hf://ns/name@v1.0", "ns/name", "v1.0", "hf://ns/name@v1.0"),
    ("hf://ns/name:v1.0", "ns/name", "v1.0", "hf://ns/name@v1.0"),
    ("hf://Org_1/my.model-v2@release_2", "Org_1/my.model-v2", "release_2", None),
    ("hf://ns/name@refs/pr/12", "ns/name", "refs/pr/12", None),
    ("hf://ns/name:refs/pr/12", "ns/name", "refs/pr/12", "hf://ns/name@refs/pr/12"),
    ("hf://ns/name@refs/convert/parquet", "ns/name", "refs/convert/parquet", None),
    ("hf://a/b", "a/b", None, None),
    ("hf://ns/" + "n" * 96, "ns/" + "n" * 96, None, None),
]


@pytest.mark.parametrize(("text", "repo_id", "revision", "canonical"), ACCEPTED)
def test_accepted(text: str, repo_id: str, revision: str | None, canonical: str | None) -> None:
    ref = parse_package_ref(text)
    assert ref == HfPackageRef(repo_id, revision)
    assert isinstance(ref, HfPackageRef)
    assert str(ref) == (canonical if canonical is not None else text)
    assert parse_package_ref(str(ref)) == ref  # canonical form round-trips
    assert (ref.namespace, ref.name) == tuple(repo_id.split("/"))


REJECTED = [
    "",
    "hf://",
    "hf://name",  # no namespace
    "hf:///name",
    "hf://ns/",
    "hf://ns/name/extra",  # extra path segment
    "hf://ns/name/shared/metadata.gguf",
    "hf://datasets/ns/name",  # repo type prefix: not a package repo
    "hf://ns/name@",  # empty revision
    "hf://ns/name:",
    "hf://ns/name@main/shared/metadata.gguf",  # path after the revision
    "hf://ns/name@feature/x",  # '/' only in refs/pr/N, refs/convert/NAME
    "hf://@main",
    "hf://ns/@main",
    "hf://ns/-name",
    "hf://ns/name-",
    "hf://.ns/name",
    "hf://ns/name.",
    "hf://ns/na--me",
    "hf://ns/na..me",
    "hf://ns/name.git",
    "hf://ns/na me",
    "hf://ns/n\u00e4me",
    "hf://ns/" + "n" * 97,
    "hf://ns/name@has space",
    "hf://ns/name@a..b",
    "hf://ns/name@rev:x",  # '@' wins, and ':' is not allowed in a revision
    "hf://ns/name@-rev",
    "hf://ns/name@rev.lock",
    "hf://ns/name@a@{1}",
    "hf://ns/name@a@b",  # one revision per reference, though git allows '@'
    "hf://ns/name@" + "r" * 256,
    "hf:/ns/name",  # typo of the scheme is not silently a local path
    "hf:ns/name",
    "HF://ns/name",
]


@pytest.mark.parametrize("text", REJECTED)
def test_rejected(text: str) -> None:
    with pytest.raises(InvalidPackageRef) as info:
        parse_package_ref(text)
    err = info.value
    assert err.code == "invalid_package_ref"
    assert err.exit_code == EXIT_USAGE
    assert isinstance(err, UsageError) and isinstance(err, ValueError)
    assert ACCEPTED_FORMS in err.message
    assert repr(text) in err.message
    assert err.to_dict()["code"] == "invalid_package_ref"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hf://name", "no namespace"),
        ("hf://ns/name/extra", "extra path segments"),
        ("hf://ns/name@", "empty"),
        ("hf://ns/name:", "empty"),
        ("hf://", "names no repo"),
        ("hf:/ns/name", "start with exactly"),
        ("hf://ns/na--me", "'--'"),
    ],
)
def test_rejection_says_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(InvalidPackageRef, match=needle):
        parse_package_ref(text)


@pytest.mark.parametrize("text", ["./pkg", "/abs/pkg", "pkg", "some dir/with@at:colon", "hfpkg"])
def test_local_paths(text: str) -> None:
    ref = parse_package_ref(text)
    assert ref == LocalPackageRef(Path(text))
    assert str(ref) == str(Path(text))


def test_parse_hf_package_ref_refuses_local_paths() -> None:
    with pytest.raises(InvalidPackageRef, match="does not start with"):
        parse_hf_package_ref("./pkg")


@pytest.mark.parametrize(
    ("revision", "pinned"),
    [
        (SHA, True),
        (None, False),
        ("main", False),
        ("8f4c2d1", False),  # abbreviated: the Hub only resolves full commit hashes
        (SHA.upper(), False),  # huggingface_hub only treats lowercase hex as a commit
        (SHA[:-1], False),
        (SHA + "0", False),
    ],
)
def test_is_pinned(revision: str | None, pinned: bool) -> None:
    assert HfPackageRef("ns/name", revision).is_pinned is pinned


def test_direct_construction_is_validated() -> None:
    with pytest.raises(InvalidPackageRef, match="no namespace"):
        HfPackageRef("name")
    with pytest.raises(InvalidPackageRef, match="empty"):
        HfPackageRef("ns/name", "")


def test_refs_are_frozen_and_hashable() -> None:
    ref = HfPackageRef("ns/name", "main")
    with pytest.raises(AttributeError):
        ref.revision = "other"  # type: ignore[misc]
    assert {ref, HfPackageRef("ns/name", "main")} == {ref}


def test_at_pins_a_commit() -> None:
    ref = HfPackageRef("ns/name", "main").at(SHA)
    assert ref == HfPackageRef("ns/name", SHA) and ref.is_pinned
