"""Writing one setting back into the config file a command used (``plexd join --api URL``), keeping the rest of
the file, its comments included, as the operator wrote it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from plexd.atomicfile import write_atomic
from plexd.errors import ConfigError

_TOP_API = re.compile(r"^api:[ \t]*(?P<value>[^#\n]*?)[ \t]*(#.*)?$")
_NESTED_URL = re.compile(r"^(?P<indent>[ \t]+)url:[ \t]*[^#\n]*?[ \t]*(?P<comment>#.*)?$")


def store_api_url(path: str, url: str) -> bool:
    """Make `path` say ``api: url``; False when it already did. The file is created (0644) when missing; a
    file that would not load afterwards is left as it was, with an error."""
    from plexd import config as config_mod

    file = Path(path)
    quoted = json.dumps(url)  # a YAML double-quoted scalar, whatever the URL holds
    try:
        before = file.read_text(encoding="utf-8") if file.exists() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} to store api.url: {exc}") from None
    if before is None:
        after = f"# the control plane; written by 'plexd join'\napi: {quoted}\n"
        file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    else:
        if config_mod.load(path, env={}).api.url == url:
            return False
        after = _with_api(before, quoted, path)
    write_atomic(file, after.encode(), mode=0o644 if before is None else _mode(file))
    try:
        stored = config_mod.load(path, env={}).api.url
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


def _with_api(text: str, quoted: str, path: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _TOP_API.match(line)
        if m is None:
            continue
        if m.group("value"):
            if m.group("value").startswith("{"):
                raise ConfigError(f"{path}: api is written in flow style ({{...}}); set its url by hand")
            lines[i] = f"api: {quoted}"
            return "\n".join(lines)
        for j in range(i + 1, len(lines)):  # the long form: replace or add url in the api block
            if lines[j].strip() and not lines[j][0].isspace():
                break
            nested = _NESTED_URL.match(lines[j])
            if nested is not None:
                comment = f"  {nested.group('comment')}" if nested.group("comment") else ""
                lines[j] = f"{nested.group('indent')}url: {quoted}{comment}"
                return "\n".join(lines)
        lines.insert(i + 1, f"  url: {quoted}")
        return "\n".join(lines)
    return text + ("" if text.endswith("\n") or not text else "\n") + f"api: {quoted}\n"


def _mode(file: Path) -> int:
    try:
        return os.stat(file).st_mode & 0o777
    except OSError:
        return 0o644
