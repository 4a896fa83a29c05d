"""The ``ddpkit`` command. Thin: every sub-command calls a library function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpkit._version import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the ``ddpkit`` argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="PyTorch DistributedDataParallel building blocks: tools for "
        "LMDB image datasets and for checking a multi-node set-up.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Each sub-command registers its handler as ``func``: handler(args) -> exit code.
    handler = getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 0
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
