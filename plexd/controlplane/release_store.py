"""Where a platform-dialect node fetches a plexd release for `service.upgrade`.

The platform contract serves no artifacts to nodes: its agents download a release from where it is published (a
GitHub release page, for the Go agent) and check it against the checksum the execution names. plexd does the
same from `upgrade.release_url`, laid out as a release page is::

    {release_url}/v{version}/plexd-{os}-{arch}        the release (a zipapp: plexd.upgrade.zipapp)
    {release_url}/v{version}/plexd-{os}-{arch}.sig    its signature (plexd.upgrade.signing)

The signature is plexd's own, under the keys pinned in `upgrade.release_keys`, as in the spec dialect; the Go
agent's Sigstore bundle (`.sigstore.json`, pinned to its own release workflow) is not read. The store is not the
control plane, so nothing of the node's is sent to it: no bearer, only the User-Agent; its certificate is checked
against the system's trust store, not the control plane's CA file; its redirects are followed (a release page
hands files out from an object store). Error messages name its addresses without query or credentials (an object
store's redirect carries a signed query).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

from plexd.controlplane import http_client
from plexd.controlplane.client_errors import PermanentError, TransientError

WHAT = "release download"
MISSING = ("the platform contract serves no plexd releases to nodes, and upgrade.release_url is empty: set it to "
           "where plexd releases are published")
# A release page hands the file out from elsewhere (GitHub: a 302 to its object store). Followed, unlike the
# control plane's redirects: nothing of the node's goes with them, and the signature and checksum vouch for what
# comes back wherever it came from.
REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5


def asset_url(release_url: str, version: str, os_name: str, arch: str) -> str:
    """The release's (or, with arch ending in ``.sig``, its signature's) address under `release_url` (a query it
    has is kept, after the path)."""
    def part(text: str) -> str:
        return quote(text, safe="")

    base = urlsplit(release_url)
    path = f"{base.path.rstrip('/')}/v{part(version)}/plexd-{part(os_name)}-{part(arch)}"
    return urlunsplit((base.scheme, base.netloc, path, base.query, ""))


def shown(url: str) -> str:
    """An address as a message may name it: scheme, host and path."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.hostname or "", parts.path, "", ""))[:300]


@contextlib.asynccontextmanager
async def open_release(http: http_client.HTTPClient, release_url: str, user_agent: str, version: str, os_name: str,
                       arch: str) -> AsyncIterator[http_client.Response]:
    """The streamed release file; PermanentError when there is no store or it has no such file, TransientError
    when it cannot be reached or fails (5xx, 429)."""
    if not release_url:
        raise PermanentError(WHAT, 0, MISSING)
    url = asset_url(release_url, version, os_name, arch)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            response = await http.send("GET", url, headers={"User-Agent": user_agent}, read_timeout=None)
        except http_client.TransportError as exc:
            raise TransientError(f"{WHAT} from {shown(url)}", message=str(exc)) from None
        location = response.headers.get("location", "") if response.status_code in REDIRECTS else ""
        if not location:
            break
        await response.aclose()
        url = urljoin(url, location)
        if urlsplit(url).scheme not in ("http", "https"):
            raise PermanentError(WHAT, 0, f"redirected to {shown(url)!r}, which is not an http(s) address")
    else:
        raise PermanentError(WHAT, 0, f"more than {MAX_REDIRECTS} redirects from {shown(release_url)}")
    try:
        status = response.status_code
        if status == 404:
            raise PermanentError(WHAT, status, f"{shown(url)} does not exist")
        if status >= 500 or status == 429:
            raise TransientError(WHAT, status, shown(url))
        if not 200 <= status < 300:
            raise PermanentError(WHAT, status, shown(url))
        yield response
    finally:
        await response.aclose()
