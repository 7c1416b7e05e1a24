"""Writing one setting back into the config file a command used (``plexd join --api URL``), or taking one out of
it (the bootstrap token once it is spent), keeping the rest of the file, its comments included, as the operator
wrote it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import ConfigError

_TOP_API = re.compile(r"^api:[ \t]*(?P<value>[^#\n]*?)[ \t]*(#.*)?$")
_NESTED_URL = re.compile(r"^(?P<indent>[ \t]+)url:[ \t]*[^#\n]*?[ \t]*(?P<comment>#.*)?$")


INSECURE_NOTE = "  # plain HTTP or no TLS verification: allowed when 'plexd join' ran with it"


def store_api_url(path: str, url: str, *, allow_insecure: bool = False) -> bool:
    """Make `path` say ``api: url``; False when it already did. The file is created (0644) when missing; a
    file that would not load afterwards is left as it was, with an error. `allow_insecure`: the join ran with
    api.allow_insecure (a lab's plain-HTTP control plane): the file says so too, or `plexd up` would refuse it."""
    from plexd.config import settings as config_mod

    file = Path(path)
    quoted = json.dumps(url)  # a YAML double-quoted scalar, whatever the URL holds
    try:
        before = file.read_text(encoding="utf-8") if file.exists() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} to store api.url: {exc}") from None
    if before is None:
        api = f"api:\n  url: {quoted}\n  allow_insecure: true{INSECURE_NOTE}" if allow_insecure else f"api: {quoted}"
        after = f"# the control plane; written by 'plexd join'\n{api}\n"
        file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    else:
        current = config_mod.load(path, env={"PLEXD_API_ALLOW_INSECURE": "true"} if allow_insecure else {})
        if current.api.url == url and (current.api.allow_insecure or not allow_insecure):
            return False
        after = _with_api(before, quoted, path, allow_insecure)
    write_atomic(file, after.encode(), mode=0o644 if before is None else _mode(file))
    try:
        stored = config_mod.load(path, env={}).api.url  # as `plexd up` will read it: without the join's env
    except ConfigError as exc:
        stored = f"an error: {exc}"
    if stored != url:
        if before is None:
            file.unlink()
        else:
            write_atomic(file, before.encode(), mode=_mode(file))
        raise ConfigError(f"could not store api.url in {path} (it would read back as {stored}); the file is "
                          f"unchanged: set 'api: {url}' there by hand")
    return True


def _with_api(text: str, quoted: str, path: str, allow_insecure: bool = False) -> str:
    lines = text.split("\n")
    insecure = [f"  allow_insecure: true{INSECURE_NOTE}"] if allow_insecure else []
    for i, line in enumerate(lines):
        m = _TOP_API.match(line)
        if m is None:
            continue
        if m.group("value"):
            if m.group("value").startswith("{"):
                raise ConfigError(f"{path}: api is written in flow style ({{...}}); set its url by hand")
            lines[i:i + 1] = ["api:", f"  url: {quoted}", *insecure] if insecure else [f"api: {quoted}"]
            return "\n".join(lines)
        end = len(lines)
        for j in range(i + 1, len(lines)):  # the long form: replace or add url in the api block
            if lines[j].strip() and not lines[j][0].isspace():
                end = j
                break
        block = [ln for ln in lines[i + 1:end] if not (insecure and ln.strip().startswith("allow_insecure:"))]
        for j, nested_line in enumerate(block):
            nested = _NESTED_URL.match(nested_line)
            if nested is not None:
                comment = f"  {nested.group('comment')}" if nested.group("comment") else ""
                block[j] = f"{nested.group('indent')}url: {quoted}{comment}"
                break
        else:
            block.insert(0, f"  url: {quoted}")
        lines[i + 1:end] = [*block, *insecure]
        return "\n".join(lines)
    api = ["api:", f"  url: {quoted}", *insecure] if insecure else [f"api: {quoted}"]
    return text + ("" if text.endswith("\n") or not text else "\n") + "\n".join(api) + "\n"


def _mode(file: Path) -> int:
    try:
        return os.stat(file).st_mode & 0o777
    except OSError:
        return 0o644


_TOP_TOKEN = re.compile(r"^token:[ \t]*(?P<value>[^#\n]*?)[ \t]*(#.*)?$")
_NESTED_VALUE = re.compile(r"^[ \t]+value:")


def remove_token_value(path: str) -> bool:
    """Take ``token.value`` (the bootstrap token) out of the config file at `path`; False when it held none. The
    rest of the file is kept as it was (a flow-style ``token: {...}`` line is rewritten without its value). The
    result must load with every other setting unchanged, else the file is left as it was, with an error."""
    from plexd.config import settings as config_mod

    file = Path(path)
    try:
        before = file.read_text(encoding="utf-8")
        loaded = config_mod.load(path, env={})
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} to remove token.value: {exc}") from None
    if not loaded.token.value:
        return False
    after = _without_token_value(before, path)
    mode = _mode(file)
    write_atomic(file, after.encode(), mode=mode)
    try:
        reloaded: Any = config_mod.load(path, env={})
        kept = _leaves(reloaded, skip="token.value") == _leaves(loaded, skip="token.value")
        problem = "" if not reloaded.token.value and kept else "other settings would change"
    except ConfigError as exc:
        problem = str(exc)
    if problem:
        write_atomic(file, before.encode(), mode=mode)
        raise ConfigError(f"could not remove token.value from {path} ({problem}); the file is unchanged: remove "
                          "the token from it by hand")
    return True


def _without_token_value(text: str, path: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _TOP_TOKEN.match(line)
        if m is None:
            continue
        if m.group("value"):  # flow style: rewrite the mapping without its value
            import yaml

            try:
                mapping = yaml.safe_load(m.group("value"))
            except yaml.YAMLError:  # a mapping over several lines, a "#" in the token: not one line's YAML
                raise ConfigError(f"{path}: token is written in a form this edit cannot rewrite safely; remove "
                                  "token.value by hand") from None
            if not isinstance(mapping, dict):
                raise ConfigError(f"{path}: token is not a mapping; remove token.value by hand")
            mapping.pop("value", None)
            lines[i] = "token: " + yaml.safe_dump(mapping, default_flow_style=True, width=1 << 16).strip() \
                if mapping else ""
            return "\n".join(lines)
        block = []  # the lines of the token block
        for j in range(i + 1, len(lines)):
            if lines[j].strip() and not lines[j][0].isspace():
                break
            block.append(j)
        values = [j for j in block if _NESTED_VALUE.match(lines[j])]
        if not values:
            break
        first = values[0]
        indent = len(lines[first]) - len(lines[first].lstrip())
        end = first + 1  # a value continued on deeper-indented lines goes with it
        while end in block and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > indent:
            end += 1
        del lines[first:end]
        rest = []
        for line in lines[i + 1:]:
            if line.strip() and not line[0].isspace():
                break
            rest.append(line.strip())
        if not any(line and not line.startswith("#") for line in rest):
            del lines[i]  # the block held nothing else: `token:` alone would read as null
        return "\n".join(lines)
    raise ConfigError(f"{path}: token.value is not written as a 'value:' line under 'token:'; remove it by hand")


def _leaves(config: Any, skip: str, prefix: str = "") -> dict[str, Any]:
    """Every setting of a Config by its dotted key (`skip` left out), to compare two loads of a file."""
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name in ("sources", "config_file"):
            continue
        key, value = prefix + f.name, getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, skip, key + "."))
        elif key != skip:
            out[key] = value
    return out
