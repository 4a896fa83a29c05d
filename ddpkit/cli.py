"""The ``ddpkit`` command. Thin: every sub-command calls a library function."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence

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
    _add_lmdb(commands)
    _add_plot(commands)
    return parser


def _add_plot(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plot = commands.add_parser(
        "plot",
        help="draw a run's learning curves into an image (PNG, PDF, SVG ...)",
        description="Draw the learning curves of a run from its metrics.jsonl (the log_dir "
        "of fit, the checkpoint directory of the example): loss, top-1/top-5, learning "
        "rate, images/s and the time spent waiting for data, per epoch. Needs matplotlib: "
        "pip install 'ddpkit[plot]'.",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the directory holding metrics.jsonl")
    plot.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the file to write, exactly; its suffix picks the format (.png, .pdf, .svg ...); "
        "default: RUN_DIR/curves.png",
    )
    plot.set_defaults(func=_run_plot, command_parser=plot)


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
        "--master-port",
        type=_whole(1, 65535),
        help="the rendezvous port (default: MASTER_PORT)",
    )
    doctor.add_argument(
        "--world-size",
        type=_whole(1),
        help="the total number of processes, to compare with the launcher",
    )
    doctor.add_argument(
        "--timeout",
        type=_seconds,
        default=3.0,
        help="seconds to wait for a TCP connection to the master (default: 3)",
    )
    doctor.add_argument(
        "--checkpoints",
        metavar="DIR|URL",
        help="check the checkpoint directory or store (s3://bucket/prefix): reachable with "
        "these credentials, writable, and what run it holds",
    )
    doctor.set_defaults(func=_run_doctor, command_parser=doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from ddpkit.distributed import doctor  # imports torch: only when the command runs

    checks = doctor.run_checks(
        master_addr=args.master_addr,
        master_port=args.master_port,
        world_size=args.world_size,
        connect_timeout=args.timeout,
    )
    if args.checkpoints is not None:
        from ddpkit.checkpoint.store import check_location

        status, detail, fix = check_location(args.checkpoints)
        checks.append(doctor.Check("checkpoints", status, detail, fix))
    print(doctor.format_report(checks))
    return doctor.exit_code(checks)


def _add_lmdb(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = commands.add_parser(
        "lmdb",
        help="build, describe and verify LMDB image databases",
        description="Build a ddpkit LMDB database from an ImageFolder tree, a list file or "
        "Parquet files, describe one, or decode every image of one.",
    )
    actions = group.add_subparsers(dest="lmdb_command", metavar="ACTION", required=True)

    build = actions.add_parser(
        "build",
        help="write SOURCE's images and labels into a new database at OUTPUT",
        description="Write SOURCE's images and labels into a new database at OUTPUT. SOURCE "
        "is an ImageFolder tree, a list file ('path,label' or 'path label' lines; the labels "
        "all integer indices or all class names) or a Parquet file or directory. Nothing "
        "appears at OUTPUT unless the build completes.",
    )
    build.add_argument("source", metavar="SOURCE")
    build.add_argument("output", metavar="OUTPUT")
    build.add_argument(
        "--format",
        dest="source_format",
        choices=("auto", "imagefolder", "list", "parquet"),
        default="auto",
        help="how to read SOURCE (default: tell from the path)",
    )
    build.add_argument("--root", help="list files: base directory of relative paths")
    build.add_argument("--image-column", default="image", help="Parquet image column")
    build.add_argument("--label-column", default="label", help="Parquet label column")
    build.add_argument(
        "-j",
        "-w",
        "--workers",
        type=_whole(1, MAX_THREADS),
        help="reading threads (default: usable CPUs)",
    )
    build.add_argument(
        "--max-side",
        type=_whole(1),
        metavar="PX",
        help="shrink larger images to this longer side",
    )
    build.add_argument(
        "--quality", type=_whole(1, 100), default=90, help="JPEG quality of shrunk images, 1..100"
    )
    build.add_argument(
        "--check",
        choices=("none", "header", "decode"),
        default="header",
        help="how hard to check each image (default: header)",
    )
    build.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="on a bad image: stop (default) or leave it out and list it",
    )
    build.add_argument(
        "--map-size",
        type=_byte_size,
        metavar="BYTES",
        help="first LMDB map size, 4K to 64T, e.g. 64K, 10M, 2G (default: 1G; it doubles "
        "when full)",
    )
    _add_max_pixels(build)
    build.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT (an LMDB database only)",
    )
    build.add_argument(
        "--allow-empty",
        action="store_true",
        help="write a database even when no image could be stored (an error otherwise)",
    )
    _add_no_progress(build)
    build.set_defaults(func=_run_lmdb_build, command_parser=build)

    info = actions.add_parser("info", help="describe a database")
    info.add_argument("path", metavar="PATH")
    info.add_argument("--json", action="store_true", help="print the description as JSON")
    info.set_defaults(func=_run_lmdb_info, command_parser=info)

    verify = actions.add_parser(
        "verify", help="decode every image of a database; exits 1 if any fails"
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument(
        "-j",
        "-w",
        "--workers",
        type=_whole(1, MAX_THREADS),
        help="decoding threads (default: usable CPUs)",
    )
    _add_max_pixels(verify)
    _add_no_progress(verify)
    verify.set_defaults(func=_run_lmdb_verify, command_parser=verify)


def _add_max_pixels(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--max-pixels",
        type=_whole(1),
        metavar="N",
        help="refuse an image whose header claims more pixels (default: Pillow's limit, 178956970)",
    )


def _add_no_progress(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none either when stderr is not a terminal)",
    )


def _progress(args: argparse.Namespace) -> bool:
    # A bar redrawn with \r is noise in a log file or a pipe.
    return not args.no_progress and sys.stderr.isatty()


# The library's own limits, repeated here so that parsing imports neither torch nor lmdb
# (ddpkit.data.threads.MAX_WORKERS, ddpkit.data.lmdb_build.MIN_MAP_SIZE / MAX_MAP_SIZE).
MAX_THREADS = 1024
MIN_MAP_SIZE = 4096
MAX_MAP_SIZE = 64 << 40
# A socket timeout beyond about 2**33 s overflows; no connection is worth waiting a day for.
_MAX_SECONDS = 86400.0


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in ``low..high``; argparse names the flag."""
    span = f"{low}..{high}" if high is not None else f"{low} or more"

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ({span})") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: use {span}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= _MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds above 0 and at most {_MAX_SECONDS:.0f} (e.g. 3)"
        )
    return value


def _byte_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)(I?B)?", text.strip().upper())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with K, M, G or T (64K, 10M, 2G)"
        )
    value = int(match[1]) << (10 * " KMGT".index(match[2] or " "))
    if not MIN_MAP_SIZE <= value <= MAX_MAP_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text!r} ({value} bytes) is out of range: use 4K to 64T (LMDB maps the whole "
            "size into memory addresses; the map doubles when full, so a small start is fine)"
        )
    return value


def _reporting_errors(
    run: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Turn the errors a user can fix into ``error: ...`` on stderr and exit code 1."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (ValueError, OSError) as exc:  # ImageError, LMDBFormatError, FileExistsError ...
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return handler


@_reporting_errors
def _run_lmdb_build(args: argparse.Namespace) -> int:
    from ddpkit.data.lmdb_build import build_lmdb  # imports PIL, pyarrow: only when run

    summary = build_lmdb(
        args.source,
        args.output,
        source_format=args.source_format,
        root=args.root,
        image_column=args.image_column,
        label_column=args.label_column,
        workers=args.workers,
        max_side=args.max_side,
        quality=args.quality,
        check=args.check,
        on_error=args.on_error,
        map_size=args.map_size,
        overwrite=args.overwrite,
        progress=_progress(args),
        allow_empty=args.allow_empty,
        max_pixels=args.max_pixels,
    )
    for where, reason in summary.skipped:
        print(f"skipped {where}: {reason}")
    print(summary.format())
    return 0


@_reporting_errors
def _run_lmdb_info(args: argparse.Namespace) -> int:
    from ddpkit.data.lmdb_inspect import describe_lmdb

    info = describe_lmdb(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    size = info["size_bytes"]
    print(f"path:     {info['path']}")
    print(
        f"format:   {info['format']} version {info['format_version']} "
        f"(written by ddpkit {info['ddpkit_version']})"
    )
    print(f"samples:  {info['samples']}")
    print(f"size:     {size / 2**20:.1f} MiB ({size} bytes)")
    print(f"classes:  {len(info['classes'])}")
    width = max((len(name) for name in info["classes"]), default=0)
    for label, (name, count) in enumerate(info["classes"].items()):
        print(f"  {label:>5}  {name:<{width}}  {count}")
    print("metadata:")
    for key, value in info["metadata"].items():
        print(f"  {key}: {value}")
    return 0


@_reporting_errors
def _run_lmdb_verify(args: argparse.Namespace) -> int:
    from ddpkit.data.lmdb_inspect import verify_report

    report = verify_report(
        args.path, workers=args.workers, progress=_progress(args), max_pixels=args.max_pixels
    )
    for bad in report.bad:
        where = f" ({bad.path})" if bad.path else ""
        print(f"index {bad.index}{where}: {bad.reason}")
    if not report.ok:
        print(f"{len(report.bad)} bad sample(s) in {args.path}", file=sys.stderr)
        return 1
    print(f"ok: {report.samples} samples decode")
    return 0


@_reporting_errors
def _run_plot(args: argparse.Namespace) -> int:
    from ddpkit.training.plotting import PlotUnavailable, plot_run

    try:
        out = plot_run(args.run_dir, args.output)
    except PlotUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # parse_args would print the top-level usage; the sub-command's is the helpful one.
        command: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    # Each sub-command registers its handler as ``func``: handler(args) -> exit code.
    handler = getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 0
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
