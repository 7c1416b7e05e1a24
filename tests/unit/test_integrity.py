"""Binary checksum (docs/decisions.md, Binary checksum), hook discovery with ownership checks, and the capabilities
document (docs/protocol.md §1.8)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zipfile

import pytest

from plexd.trust.integrity import (
    binary_checksum,
    capabilities_document,
    package_root,
    scan_hooks,
    sha256_file,
)


def make_pkg(root):
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("x = 1\n")
    (root / "sub" / "mod.py").write_text("y = 2\n")
    (root / "data.json").write_text("{}")
    return root


def test_binary_checksum_is_the_documented_formula(tmp_path):
    pkg = make_pkg(tmp_path / "plexd")
    lines = sorted(f"{rel}\0{hashlib.sha256((pkg / rel).read_bytes()).hexdigest()}\n"
                   for rel in ("__init__.py", "sub/mod.py", "data.json"))
    assert binary_checksum(pkg) == hashlib.sha256("".join(lines).encode()).hexdigest()


def test_binary_checksum_ignores_bytecode_and_tracks_source(tmp_path):
    pkg = make_pkg(tmp_path / "plexd")
    before = binary_checksum(pkg)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    (pkg / "sub" / "stale.pyc").write_bytes(b"junk")
    assert binary_checksum(pkg) == before
    (pkg / "sub" / "mod.py").write_text("y = 3\n")
    assert binary_checksum(pkg) != before


def test_binary_checksum_same_content_same_value_anywhere(tmp_path):
    a = make_pkg(tmp_path / "a" / "plexd")
    b = tmp_path / "b" / "plexd"
    shutil.copytree(a, b)
    assert binary_checksum(a) == binary_checksum(b)


def test_binary_checksum_of_installed_package_is_stable_hex():
    first = binary_checksum()
    assert len(first) == 64 and int(first, 16) >= 0
    assert binary_checksum(package_root()) == first


def test_binary_checksum_of_a_zipapp_is_the_file_hash(tmp_path):
    app = tmp_path / "plexd.pyz"
    with zipfile.ZipFile(app, "w") as zf:
        zf.writestr("plexd/__init__.py", "")
    assert binary_checksum(app / "plexd") == sha256_file(app)


# -- hooks ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hooks_dir(tmp_path):
    d = tmp_path / "hooks.d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    return d


def hook(d, name, body="#!/bin/sh\necho hi\n", mode=0o755, sidecar=None):
    p = d / name
    p.write_text(body)
    os.chmod(p, mode)
    if sidecar is not None:
        (d / f"{name}.json").write_text(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
    return p


def test_scan_finds_executables_only_sorted_with_checksums(hooks_dir):
    b = hook(hooks_dir, "backup.sh")
    a = hook(hooks_dir, "a-first")
    hook(hooks_dir, "notes.txt", mode=0o644)
    (hooks_dir / "subdir").mkdir()
    scan = scan_hooks(hooks_dir)
    assert [h.name for h in scan.hooks] == ["a-first", "backup.sh"]  # name = exact file name, extension kept
    assert scan.find("backup.sh").checksum == hashlib.sha256(b.read_bytes()).hexdigest()
    assert scan.find("a-first").path == str(a)
    assert scan.refused == ()


def test_sidecar_is_read(hooks_dir):
    hook(hooks_dir, "backup", sidecar={"description": "Back up /srv", "timeout": "30s", "sandbox": "none",
                                       "parameters": [{"name": "target", "type": "string", "required": True,
                                                       "description": "where"}]})
    (h,) = scan_hooks(hooks_dir).hooks
    assert h.to_wire() == {
        "name": "backup", "description": "Back up /srv", "source": "local", "checksum": h.checksum,
        "parameters": [{"name": "target", "type": "string", "required": True, "description": "where"}],
        "timeout": "30s", "sandbox": "none",
    }


@pytest.mark.parametrize("sidecar,why", [
    ("{not json", "ignored"),
    ('["list"]', "not a JSON object"),
    ('{"timeout": "soon"}', "not a Go duration"),
    ('{"timeout": "-30s"}', "not a positive duration"),  # every run would have ended at once as a timeout
    ('{"timeout": "0s"}', "not a positive duration"),
    ('{"parameters": [{"type": "string"}]}', "needs a string name"),
])
def test_malformed_sidecar_is_ignored_with_a_warning(hooks_dir, caplog, sidecar, why):
    hook(hooks_dir, "backup", sidecar=sidecar)
    with caplog.at_level(logging.WARNING):
        scan = scan_hooks(hooks_dir)
    (h,) = scan.hooks
    assert h.description == "" and h.parameters is None
    assert why in scan.warnings[0] and why in caplog.text


def test_hook_not_owned_by_root_is_refused(hooks_dir, caplog):
    p = hook(hooks_dir, "evil")
    os.chown(p, 1000, 1000)
    hook(hooks_dir, "good")
    with caplog.at_level(logging.WARNING):
        scan = scan_hooks(hooks_dir)
    assert [h.name for h in scan.hooks] == ["good"]
    assert scan.refused[0].name == "evil" and "owned by uid 1000" in scan.refused[0].reason
    assert "hook evil refused" in caplog.text


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_group_or_other_writable_hook_is_refused(hooks_dir, mode):
    hook(hooks_dir, "loose", mode=mode)
    scan = scan_hooks(hooks_dir)
    assert scan.hooks == ()
    assert "writable by group or other" in scan.refused[0].reason and f"{mode:04o}" in scan.refused[0].reason


def test_writable_hooks_directory_refuses_every_hook(hooks_dir):
    hook(hooks_dir, "fine")
    os.chmod(hooks_dir, 0o777)
    scan = scan_hooks(hooks_dir)
    assert scan.hooks == () and "hooks directory" in scan.refused[0].reason


def test_symlink_inside_the_directory_is_judged_by_its_target(hooks_dir):
    target = hooks_dir / "real-hook"
    target.write_text("#!/bin/sh\n")
    os.chmod(target, 0o755)
    (hooks_dir / "linked").symlink_to(target)
    assert [h.name for h in scan_hooks(hooks_dir).hooks] == ["linked", "real-hook"]
    os.chown(target, 1000, 1000)
    assert {r.name for r in scan_hooks(hooks_dir).refused} == {"linked", "real-hook"}


def test_symlink_leaving_the_directory_is_refused_with_the_reason(hooks_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("#!/bin/sh\n")
    os.chmod(target, 0o755)
    (hooks_dir / "linked").symlink_to(target)
    (hooks_dir / "dotdot").symlink_to(hooks_dir / ".." / "elsewhere")
    scan = scan_hooks(hooks_dir)
    assert scan.hooks == ()
    assert {r.name: r.reason for r in scan.refused} == {
        "dotdot": f"symlink to {target} leaves the hooks directory {hooks_dir}",
        "linked": f"symlink to {target} leaves the hooks directory {hooks_dir}"}


def test_missing_hooks_directory_means_no_hooks(tmp_path):
    scan = scan_hooks(tmp_path / "absent")
    assert scan.hooks == () and scan.refused == ()


def test_capabilities_document_shape(hooks_dir):
    hook(hooks_dir, "x")
    hooks = scan_hooks(hooks_dir).hooks
    doc = capabilities_document("0.1.0", "ab" * 32, hooks)
    assert list(doc) == ["binary", "builtin_actions", "hooks"]
    assert doc["binary"] == {"version": "0.1.0", "checksum": "ab" * 32}
    assert doc["builtin_actions"] is None  # Go nil slice → null
    assert doc["hooks"][0]["source"] == "local" and doc["hooks"][0]["parameters"] is None
    assert capabilities_document("0.1.0", "c", ())["hooks"] is None
    assert capabilities_document("0.1.0", "c", (), [{"name": "gather_info"}])["builtin_actions"] == [
        {"name": "gather_info"}]


def test_example_hook_in_repo_passes_the_checks(tmp_path):
    """The shipped example (hooks/) is discovered with its sidecar once installed root-owned 0755."""
    repo_hooks = os.path.join(os.path.dirname(__file__), "..", "..", "hooks")
    d = tmp_path / "hooks.d"
    shutil.copytree(repo_hooks, d)
    os.chmod(d, 0o755)
    for entry in d.iterdir():
        os.chmod(entry, 0o755 if entry.suffix != ".json" else 0o644)
    scan = scan_hooks(d)
    assert scan.hooks and scan.refused == () and scan.warnings == ()
    assert all(h.description for h in scan.hooks)
