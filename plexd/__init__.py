"""plexd: joins a Linux machine to a WireGuard mesh run by a control plane."""

import sys

__version__ = "0.1.0"

# httpx imports its command-line tool (click, pygments and, when installed, rich: ~2 MiB resident) on
# `import httpx` whenever those packages happen to be installed (uvicorn brings click). No plexd process uses
# that tool; marking the module absent makes httpx fall back to its stub `main` (its documented ImportError path).
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[assignment]
