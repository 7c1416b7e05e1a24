"""`plexd-devplane`: run the reference control plane (`serve`), drive it (`admin ...`), or try it (`demo`).

Argument parsing only; each command calls one function. User errors end in one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import sys

from plexd.base.errors import PlexdError

# What `pip install 'plexd[devplane]'` brings; the node daemon itself never imports them.
EXTRA_MODULES = frozenset({"starlette", "sse_starlette", "uvicorn"})


def _duration(text: str) -> float:
    from plexd.base import gojson

    try:
        seconds = gojson.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plexd-devplane",
        description="The reference control plane for plexd: a small, real server speaking the plexd protocol, "
                    "for trying plexd on one machine and for tests.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", help="run the control plane",
                           description="Run the control plane. Prints 'plexd-devplane listening on URL' when ready.")
    serve.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT to listen on; PORT 0 picks a free port "
                                                                  "(default %(default)s)")
    serve.add_argument("--db", default="devplane.db", help="SQLite database file (created if missing; default "
                                                           "%(default)s)")
    serve.add_argument("--admin-token-file", help="file holding the admin token (default: <db>.admin-token, "
                                                  "generated on first start)")
    serve.add_argument("--heartbeat-interval", type=_duration, default=30.0, metavar="DURATION",
                       help="expected node heartbeat interval; 3 missed = unreachable, 10 = offline (default 30s)")
    serve.add_argument("--keepalive", type=_duration, default=15.0, metavar="DURATION",
                       help="SSE keepalive comment interval (default 15s)")
    serve.add_argument("--ip-cooldown", type=_duration, default=3600.0, metavar="DURATION",
                       help="how long a released mesh IP rests before reuse (default 1h)")
    serve.add_argument("--replay-window", type=_duration, default=300.0, metavar="DURATION",
                       help="a stream opened without Last-Event-ID first gets the events of this window (default 5m)")
    serve.add_argument("--artifacts-dir", help="directory served at /v1/artifacts/plexd/VERSION/OS/ARCH "
                                               "(default <db>.artifacts)")
    serve.add_argument("--dialect", default="spec", choices=["spec", "platform"],
                       help="the contract the node API speaks: spec (docs/protocol.md) or platform "
                            "(docs/platform-dialect.md); a database serves the one it was made with (default spec)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    from plexd.devplane import admin_cli

    admin_cli.add_parser(sub)

    demo = sub.add_parser("demo", help="a devplane and N nodes in network namespaces forming a real mesh (needs root)")
    demo.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    demo.add_argument("--nat", action="store_true",
                      help="put every node behind its own NAT router; they find each other over STUN (coturn)")
    demo.add_argument("--bridge", action="store_true",
                      help="a bridge and two nodes behind symmetric NATs, which reach each other through its relay")
    demo.add_argument("--dialect", default="spec", choices=["spec", "platform"],
                      help="the contract the devplane and the nodes speak (default spec)")
    demo.add_argument("--keep", action="store_true", help="leave the lab running (remove it later with --down)")
    demo.add_argument("--down", action="store_true", help="remove a lab left by --keep")
    demo.set_defaults(func=cmd_demo)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from plexd.base.log import setup_logging
    from plexd.devplane.serve import ServeOptions, serve

    setup_logging(args.log_level)
    serve(ServeOptions(listen=args.listen, db=args.db, admin_token_file=args.admin_token_file,
                       heartbeat_interval=args.heartbeat_interval, keepalive=args.keepalive,
                       ip_cooldown=args.ip_cooldown, replay_window=args.replay_window,
                       artifacts_dir=args.artifacts_dir, dialect=args.dialect))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from plexd.devplane import demo

    return demo.run(args) or 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlexdError as exc:
        print(f"plexd-devplane: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRA_MODULES:
            raise  # not the extra: a bug, with its traceback
        print(f"plexd-devplane: the reference control plane needs the 'devplane' extra (module {missing} is "
              "missing): pip install 'plexd[devplane]'", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
