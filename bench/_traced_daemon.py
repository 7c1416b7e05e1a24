"""`plexd up` under tracemalloc, for the connected benches (PLEXD_BENCH_TRACEMALLOC=/path/out.snap).

SIGUSR1 writes a tracemalloc snapshot to that path (load it with `tracemalloc.Snapshot.load`), so a bench can
take it while the daemon is connected and idle, not at shutdown when most of it is already freed. It also prints
the traced peak and the allocators' own statistics (pymalloc arenas, glibc arenas) to stderr (the daemon's log):
live objects vs. memory the allocators hold, and writes the modules imported so far to path.modules.
PLEXD_BENCH_TRACEMALLOC_FRAMES=0: statistics only, no tracing.
PLEXD_BENCH_TRACEMALLOC_PROFILE=/path/out.prof:SECONDS: cProfile the event loop's thread from SECONDS after the start
(past the set-up) until the snapshot; read it with `python -m pstats`."""

import ctypes
import os
import signal
import sys
import tracemalloc

FRAMES = int(os.environ.get("PLEXD_BENCH_TRACEMALLOC_FRAMES", "12"))
if FRAMES:
    tracemalloc.start(FRAMES)
_PROFILE = os.environ.get("PLEXD_BENCH_TRACEMALLOC_PROFILE", "")  # path:delay — cProfile the event loop's thread
_profiler = None
if _PROFILE:
    import cProfile
    import threading

    _profiler = cProfile.Profile()

    def _start_profile() -> None:
        # enabled from a timer thread would profile that thread: ask the loop's thread through a signal
        os.kill(os.getpid(), signal.SIGUSR2)

    signal.signal(signal.SIGUSR2, lambda *_: _profiler.enable())
    threading.Timer(float(_PROFILE.split(":")[1]), _start_profile).start()


def _dump(*_: object) -> None:
    if _profiler is not None:
        _profiler.disable()
        _profiler.dump_stats(_PROFILE.split(":")[0])
    path = os.environ["PLEXD_BENCH_TRACEMALLOC"]
    if FRAMES:
        current, peak = tracemalloc.get_traced_memory()
        print(f"tracemalloc: current {current / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB", file=sys.stderr)
        tracemalloc.take_snapshot().dump(path + ".tmp")
    else:
        open(path + ".tmp", "wb").close()
    with open(path + ".modules", "w") as out:  # what the daemon has imported by now, lazily imported ones too
        out.write("\n".join(sorted(sys.modules)) + "\n")
    sys._debugmallocstats()
    sys.stderr.flush()
    ctypes.CDLL("libc.so.6").malloc_stats()
    os.replace(path + ".tmp", path)  # the bench waits for the name: it only ever sees a whole snapshot


signal.signal(signal.SIGUSR1, _dump)

from plexd.cli import main  # noqa: E402 - imported under tracing on purpose

sys.exit(main(["up"]))
