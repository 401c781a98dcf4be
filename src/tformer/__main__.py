import os
import signal
import sys


def _interrupted_at_start(signum: int, frame: object) -> None:
    """Ctrl-C while the imports load: nothing to save yet, so leave at once, as shells
    expect of an interrupted command, without a traceback from inside an import."""
    print("tformer: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted_at_start)
from tformer.cli import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)

if __name__ == "__main__":
    raise SystemExit(main())
