"""The signing key file: `data_dir/signing_public_key`, converged to the key the verifier trusts.

The one domain whose desired value does not come from the desired model: the model's `signing_keys` include what
an (unsigned) state pull said, and keys change only through a signed `signing_key_rotated` event or a
registration (`plexd.controlplane.event_signing.Verifier`). So the domain asks the verifier. The event handler writes
the file itself before the event is acknowledged (a crash in between must not lose a rotation); this domain is
what finds the file deleted, edited or re-moded by hand and puts it back, as a drift line:

    signing_key_file_restored   the file was missing, held another key, or was not 0600
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from plexd.config import datadir
from plexd.controlplane.event_signing import key_fingerprint, persist_signing_key
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.desired import DesiredState

FILE_MODE = 0o600
MAX_KEY_FILE = 4096  # a key is 44 characters: anything bigger is not ours, and is not read whole


@dataclass(frozen=True)
class KeyFile:
    content: str | None  # None: no file
    mode: int = FILE_MODE


@dataclass(frozen=True)
class KeyFileWrong(Change):
    correction_type: ClassVar[str] = "signing_key_file_restored"
    key: str
    why: str

    @property
    def detail(self) -> str:
        return f"signing key file {datadir.SIGNING_KEY}: {self.why}; restored ({key_fingerprint(self.key)})"


class SigningKeyFile:
    name = "signing_key"
    touches_machine = True
    acts_while_held = False

    def __init__(self, data_dir: str | Path, trusted: Callable[[], str | None]) -> None:
        self.path = Path(data_dir) / datadir.SIGNING_KEY
        self._trusted = trusted  # the verifier's current key
        self._written: str | None = None  # the key the file held at the last read or write

    def status(self) -> dict[str, str] | None:
        key = self._trusted()
        return {"current": key_fingerprint(key)} if key else None

    async def observe(self, desired: DesiredState) -> KeyFile:
        return await asyncio.to_thread(self._read)

    def _read(self) -> KeyFile:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return KeyFile(None)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE:
            return KeyFile("", stat.S_IMODE(st.st_mode))
        return KeyFile(self.path.read_text(errors="replace").strip(), stat.S_IMODE(st.st_mode))

    def plan(self, desired: DesiredState, observed: KeyFile) -> DomainResult:
        want = self._trusted()
        if not want:
            return DomainResult()  # nothing trusted (yet): never write or remove a key on a guess
        if observed.content is None:
            why = "missing"
        elif observed.content != want:
            why = f"held {key_fingerprint(observed.content) if observed.content else 'no usable key'}"
        elif observed.mode != FILE_MODE:
            why = f"mode {observed.mode:04o} != {FILE_MODE:04o}"
        else:
            return DomainResult()
        return DomainResult((KeyFileWrong(want, why),))

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: KeyFile) -> DomainResult:
        for change in planned.changes:
            assert isinstance(change, KeyFileWrong)
            await asyncio.to_thread(persist_signing_key, self.path.parent, change.key)
        self._written = self._trusted()
        return planned

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        # The handler of signing_key_rotated wrote the file; a key this domain has not seen written: read.
        return DomainResult() if self._trusted() == self._written else None

    async def teardown(self) -> None:
        """The key stays with the identity (data_dir); `plexd deregister --purge` removes both."""
