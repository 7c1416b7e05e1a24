"""One exception hierarchy for everything a user or a peer can cause.

A `PlexdError` carries a message meant for an operator: what went wrong, where (file, key, value), and what to
do. The CLI prints it as one line and exits non-zero; anything that is not a `PlexdError` is a bug and keeps
its traceback.
"""


class PlexdError(Exception):
    """Base class of every error plexd reports to an operator."""


class ConfigError(PlexdError):
    """The configuration file, an environment variable or a flag is wrong."""


class WireFormatError(PlexdError):
    """A document from the network (control plane response, event, state) does not have the expected shape.

    `path` names the offending field (e.g. ``peers[3].allowed_ips[0]``).
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)
