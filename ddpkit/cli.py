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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_doctor(commands)
    return parser


def _add_doctor(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check this node for a multi-node job (run it on every node)",
        description="Preflight checks for a multi-node job: GPUs, launcher variables, the "
        "interface that routes to the master, NCCL/Gloo settings, InfiniBand and the "
        "rendezvous port. Exits 1 when a check FAILs.",
    )
    doctor.add_argument("--master-addr", help="rank 0's host (default: MASTER_ADDR)")
    doctor.add_argument(
        "--master-port", type=int, help="the rendezvous port (default: MASTER_PORT)"
    )
    doctor.add_argument(
        "--world-size", type=int, help="the total number of processes, to compare with the launcher"
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        help="seconds to wait for a TCP connection to the master (default: 3)",
    )
    doctor.set_defaults(func=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from ddpkit import doctor  # imports torch: only when the command runs

    checks = doctor.run_checks(
        master_addr=args.master_addr,
        master_port=args.master_port,
        world_size=args.world_size,
        connect_timeout=args.timeout,
    )
    print(doctor.format_report(checks))
    return doctor.exit_code(checks)


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
