"""The docs hold to the code: every `plexd ...` command and every config key they name exists, every link and
file path they give is in the repository, and nothing in the repository (code, tests, docs, scripts) points at a
document outside it, which someone who cloned it could not follow."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from plexd.actions.builtins import BUILTINS
from plexd.cli import build_parser
from plexd.config.settings import _GROUPS, _LEAVES

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What the project's design notes lived in before docs/ held them: none of it is in the repository
OUTSIDE = re.compile(r"\.\./shared|shared/(reference|tools|seeds)|PROJECT-DECISIONS|plexd-protocol\.md|"
                     r"plexd-access-protocol\.md|(?<![-\w])environment\.md|DESIGN\.md|agent-lifecycle")
SOURCES = ["plexd", "tests", "bench", "scripts", "docs", "systemd", "deploy", "hooks"]
SOURCE_FILES = ["README.md", "Makefile", "pyproject.toml"]


def _text_files() -> list[Path]:
    files = [REPO / name for name in SOURCE_FILES]
    for top in SOURCES:
        files += [p for p in (REPO / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in ("", ".py", ".md", ".sh", ".service", ".yaml", ".yml", ".toml", ".txt", ".json")]
    return [p for p in files if p != Path(__file__)]


def test_nothing_points_at_a_document_outside_the_repository() -> None:
    found = []
    for path in _text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert found == [], "\n".join(found)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command path ("status", "actions run", "state report put") and its parser."""
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out.update({f"{name} {deeper}": p for deeper, p in _commands(sub).items()})
    return out


COMMANDS = _commands(build_parser())
# `plexd WORD [WORD]` in a code span or a code block line: the command a reader would type
COMMAND_USE = re.compile(r"(?:^|[`$][ \t]*|sudo[ \t]+)plexd[ \t]+([a-z][a-z-]*)(?:[ \t]+([a-z][a-z-]*))?"
                         r"(?:[ \t]+([a-z][a-z-]*))?", re.MULTILINE)


def _code(text: str) -> str:
    """The code spans and code blocks of a markdown text, one per line."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    return "\n".join(blocks + spans)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_plexd_command_the_docs_name_exists(doc: Path) -> None:
    missing = []
    for m in COMMAND_USE.finditer(_code(doc.read_text())):
        words = [w for w in m.groups() if w]
        if words[0] not in COMMANDS:
            missing.append(" ".join(words))
            continue
        path = words[0]
        for word in words[1:]:  # a sub-command where the command has them; an argument otherwise
            depth = path.count(" ") + 1
            subs = {c.split(" ")[-1] for c in COMMANDS if c.startswith(path + " ") and c.count(" ") == depth}
            if not subs:
                break
            if word not in subs:
                missing.append(f"{path} {word}")
                break
            path = f"{path} {word}"
    assert missing == [], f"{doc.name} names plexd commands that do not exist: {sorted(set(missing))}"


CONFIG_KEY = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)`")
TOP_GROUPS = {g for g in _GROUPS if "." not in g}
FILE_SUFFIXES = (".py", ".db", ".d", ".sh", ".json", ".log", ".md", ".yaml", ".service", ".sock", ".key", ".pyz")
# Dotted names that start like a config section and are not config: the state's wire blocks (docs/protocol.md)
WIRE_FIELDS = {"bridge.user_access", "bridge.site_to_site", "bridge.ingress", "bridge.relay", "bridge.sessions"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_the_docs_name_exists(doc: Path) -> None:
    """A dotted name in a code span that starts with a config section (`mesh.backend`, `api.tls.ca_file`) is a
    config key or section of plexd's schema."""
    known = set(_LEAVES) | set(_GROUPS)
    actions = set(BUILTINS)  # builtin actions are dotted too (`mesh.reconnect`)
    named = {m.group(1) for m in CONFIG_KEY.finditer(doc.read_text()) if m.group(1).split(".")[0] in TOP_GROUPS
             and not m.group(1).endswith(FILE_SUFFIXES) and m.group(1) not in actions | WIRE_FIELDS}
    assert sorted(k for k in named if k not in known) == [], f"{doc.name} names config keys plexd does not have"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_in_the_docs_is_a_file_in_the_repository(doc: Path) -> None:
    broken = [target for target in LINK.findall(doc.read_text())
              if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists()]
    assert broken == [], f"{doc.name} links to files that are not there"
