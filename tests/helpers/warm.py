"""``python SCRIPT ARGS`` without the imports: a process forked from the suite's preloaded server.

A fresh interpreter spends seconds importing torch, torchvision and timm before a script's first
line; a test that runs the example or a rank's script ten times pays that ten times.
:func:`warm_popen` forks the process instead from the forkserver that ``run_distributed`` uses
(``ddpkit.distributed.processes``), which imported them once, and runs the script there as
``python`` would: as ``__main__`` (a script, ``-m MODULE`` or ``-c CODE``) with its ``sys.argv``
and ``sys.path[0]``, the given environment, directory and standard streams, the caller's SIGINT
disposition (ignored under ``nohup``), its own session if asked, the exit status of an uncaught
exception, ``SystemExit`` or ``KeyboardInterrupt``, and the ``atexit`` handlers run at the end.
Processes the script starts (``spawn``'s ranks, DataLoader workers) start as they always do;
torchrun's workers too, unless its environment comes from :func:`torchrun_warm_env`. More
users of the server: a rank of ``run_distributed`` starts its forkserver DataLoader workers
from it (:func:`share_server`), the docs' shell blocks find a ``python`` (``bin/python``,
:func:`python_shim`) that runs scripts from it, and torchrun's workers can start as that
``python``.

Tests whose subject is how a process starts (a launcher's own start-up, a
console script, ``nohup``) keep ``subprocess``; the rest may use this.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ddpkit.distributed.child import die_with_parent

# What the server imports besides run_distributed's modules: the example and its models.
EXTRA_PRELOAD = ("timm", "ddpkit.testing", "ddpkit.examples.seresnext_lmdb")

PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
DEVNULL = subprocess.DEVNULL


# The server's pid, for the processes it forks (see share_server), and its address, for the
# `python` of the docs' shell blocks (see python_shim).
SERVER_VARIABLE = "DDPKIT_TEST_WARM_SERVER"
ADDRESS_VARIABLE = "DDPKIT_TEST_WARM_ADDRESS"


def start_server() -> None:
    """Start the forkserver with run_distributed's modules and :data:`EXTRA_PRELOAD`, once."""
    # Imported here: python_shim's process imports this module and needs no torch.
    from ddpkit.distributed.processes import FORKSERVER_PRELOAD, start_forkserver

    start_forkserver(mp.get_context("forkserver"), (*FORKSERVER_PRELOAD, *EXTRA_PRELOAD))
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    os.environ[SERVER_VARIABLE] = str(server._forkserver_pid)
    os.environ[ADDRESS_VARIABLE] = server._forkserver_address


def share_server() -> bool:
    """In a process the server forked, make the server this process's forkserver too.

    A rank that starts its DataLoader workers from a forkserver (``build_loader(...,
    multiprocessing_context="forkserver")``) would start a server of its own, a fresh
    interpreter importing torch and the dataset's module (about 4 s of CPU, once per rank
    and run). Its workers are the server's children either way, never the rank's; this one
    is one-threaded too and imported all of that already. A forkserver's child knows the
    server's address and holds the pipe that keeps it alive, but not its pid, so Python
    (3.11-3.13) would start another: ``ensure_running`` is all that changes. Returns
    whether this process now uses the server (False anywhere else: a launcher's fresh
    rank, a process whose forkserver already runs, the children of another server).
    """
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    ours = os.environ.get(SERVER_VARIABLE) == str(os.getppid())
    inherited = server._forkserver_address is not None and server._forkserver_alive_fd is not None
    if not ours or not inherited or server._forkserver_pid is not None:
        return False
    # It runs while its clients hold the pipe, as this process does; only the
    # resource tracker (the caller's, inherited) is left to check.
    server.ensure_running = mp.resource_tracker.ensure_running  # type: ignore[attr-defined]
    return True


SHIM = Path(__file__).resolve().parent / "bin" / "python"


def torchrun_command(nprocs: int, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` on this host with ``nprocs`` workers, then ``args``:
    a rendezvous on a port the store picks, so concurrent tests never share one."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *args]  # fmt: skip


def torchrun_warm_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a torchrun whose workers start from the server, not as fresh interpreters.

    torchrun starts each worker as ``$PYTHON_EXEC -u SCRIPT ...`` (``sys.executable``
    when ``PYTHON_EXEC`` is unset, a documented torchrun variable). Set to the shell
    blocks' ``python`` (:func:`python_shim`), a worker is a light process that forks
    the script from the server and passes torchrun's signals on, ends with the
    script's status and takes the script with it when killed: torchrun itself, its
    rendezvous, restarts, signals and the workers' environment are as always, and a
    worker starts in a fraction of a second instead of importing torch and timm.
    For tests whose subject is not how a worker starts.
    """
    start_server()
    warm = dict(env)
    helpers = str(SHIM.parent.parent)
    warm["PYTHONPATH"] = os.pathsep.join(p for p in (helpers, env.get("PYTHONPATH")) if p)
    warm.update(
        PYTHON_EXEC=str(SHIM),
        DDPKIT_TEST_PYTHON=sys.executable,
        **{name: os.environ[name] for name in (SERVER_VARIABLE, ADDRESS_VARIABLE)},
    )
    return warm


class _Fd:
    """A descriptor of the caller's, handed to the child while it starts (``DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _Fd._taken, (mp.reduction.DupFd(self.fd),)  # type: ignore[attr-defined]

    @staticmethod
    def _taken(dup: Any) -> int:
        return int(dup.detach())


def _stream(target: Any, default: int) -> tuple[int | None, int | None]:
    """(fd to give the child, our end of a pipe) for a ``subprocess``-style ``stdout=``."""
    if target is None:
        return default, None
    if target == PIPE:
        read, write = os.pipe()
        return write, read
    if target == DEVNULL:
        return os.open(os.devnull, os.O_WRONLY), None
    if isinstance(target, int):
        return target, None
    return target.fileno(), None


def _main(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    fds: tuple[int, ...],
    sigint_ignored: bool,
    new_session: bool,
    starter: int | None = None,
    unbuffered: bool = False,
    share: bool = False,
) -> None:
    # fds: standard output and error, or input, output and error
    for target, fd in zip((0, 1, 2)[-len(fds) :], fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    if len(fds) == 3:
        sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))  # noqa: SIM115
    if new_session:
        os.setsid()
    die_with_parent(os.getppid())  # the server, which ends with the test process
    if starter is not None:
        _end_with(starter)
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    # A multiprocessing child takes its own start method as the default; python's is unset.
    mp.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if share:
        share_server()
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),  # noqa: SIM115
        line_buffering=os.isatty(1),
        write_through=unbuffered,
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False),  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    how = argv[1] if argv[1] in ("-m", "-c") else "script"
    first = {"-m": os.getcwd(), "-c": ""}.get(how, str(Path(argv[1]).resolve().parent))
    sys.path[:] = [first, *paths, *(p for p in sys.path if p not in paths and p != first)]
    code = _run(argv[2:] if how != "script" else argv[1:], how)
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends python by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _end_with(starter: int) -> None:
    """Exit when the process ``starter`` ends (a thread waiting on its pidfd)."""
    handle = os.pidfd_open(starter)

    def watch() -> None:
        select.select([handle], [], [])
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="warm-end-with-starter", daemon=True).start()


def _run(args: list[str], how: str) -> int:
    """Run the script, module or ``-c`` code as ``__main__``; its exit status, as python's."""
    import runpy

    sys.argv = ["-c", *args[1:]] if how == "-c" else list(args)
    try:
        if how == "-m":
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        elif how == "-c":
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[0], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


class WarmProcess:
    """The part of ``subprocess.Popen`` the tests use, for a process :func:`warm_popen` started."""

    def __init__(self, process: Any, stdout: IO[Any] | None, stderr: IO[Any] | None,
                 args: list[str]) -> None:  # fmt: skip
        self._process = process
        self.pid: int = process.pid
        self.stdout, self.stderr = stdout, stderr
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """What the pipes held until the process closed them, then its status as ``wait``."""
        read: dict[int, Any] = {}
        threads = []
        for i, pipe in enumerate((self.stdout, self.stderr)):
            if pipe is not None:
                thread = threading.Thread(target=lambda i=i, p=pipe: read.__setitem__(i, p.read()))
                thread.daemon = True
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self.wait(timeout)
        return read.get(0), read.get(1)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self.wait()


def warm_popen(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = False,
    stdin: int | None = None,
    end_with_caller: bool = False,
    unbuffered: bool = False,
    share: bool = False,
) -> WarmProcess:
    """``subprocess.Popen`` for ``[sys.executable, SCRIPT | -m MODULE | -c CODE, ...]``.

    ``stdin``: a descriptor to give the process as its standard input (default:
    none, as a multiprocessing child has). ``end_with_caller``: the process ends
    when this one does, even by SIGKILL (a fresh child of a killed shell's
    command would end with its process group; this one is the server's child).
    ``unbuffered``: standard output and error unbuffered, as ``python -u``.
    ``share``: the process starts its forkserver DataLoader workers from the server
    (:func:`share_server`), as a rank of ``run_distributed`` does.
    """
    argv = [os.fspath(a) for a in args]
    flag = len(argv) > 1 and argv[1].startswith("-")
    if argv[0] != sys.executable or len(argv) < 2 or (flag and argv[1] not in ("-m", "-c")):
        raise ValueError(f"warm_popen runs `python SCRIPT|-m MODULE|-c CODE ...`, not {argv}")
    if not _CLIENT:  # python_shim's process uses a server that runs already
        start_server()
    out, out_read = _stream(stdout, 1)
    err, err_read = (out, None) if stderr == STDOUT else _stream(stderr, 2)
    made = ((out, out_read is not None or stdout == DEVNULL),
            (err, err_read is not None or stderr == DEVNULL))  # fmt: skip
    ours = [fd for fd, ours_ in made if ours_]
    ctx = mp.get_context("forkserver")
    sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    environ = dict(os.environ if env is None else env)
    where = os.fspath(cwd) if cwd is not None else os.getcwd()
    fds = tuple(_Fd(fd) for fd in (stdin, out, err) if fd is not None)  # type: ignore[arg-type]
    starter = os.getpid() if end_with_caller else None
    process = ctx.Process(
        target=_main,
        args=(
            argv,
            environ,
            where,
            fds,
            sigint_ignored,
            start_new_session,
            starter,
            unbuffered,
            share,
        ),
        name="ddpkit-test-warm",
    )
    try:
        process.start()
    finally:
        for fd in set(ours):
            os.close(fd)  # the child has its copies
    mode = "r" if text else "rb"
    pipes = [None if fd is None else open(fd, mode) for fd in (out_read, err_read)]  # noqa: SIM115
    return WarmProcess(process, pipes[0], pipes[1], argv)


def warm_run(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    start_new_session: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` for :func:`warm_popen`; killed at ``timeout`` (``TimeoutExpired``)."""
    stream = PIPE if capture_output else None
    process = warm_popen(args, env=env, cwd=cwd, stdout=stream, stderr=stream, text=text,
                         start_new_session=start_new_session)  # fmt: skip
    try:
        out, err = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.wait(), out, err)


# Set in a python_shim process: it talks to a server another process started.
_CLIENT = False
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2)  # fmt: skip


def python_shim(args: Sequence[str]) -> int:
    """Be ``python ARGS`` for a shell (``tests/helpers/bin/python``), from the suite's server.

    The docs' shell blocks run ``python train.py`` or ``python -m
    ddpkit.examples.seresnext_lmdb ...``; each would spend seconds importing
    torch and timm. ``python SCRIPT``, ``-m MODULE`` and ``-c CODE`` run
    forked from the server (:func:`warm_popen`) with this process's standard
    streams, directory and environment; anything else (``-O``, ``--version``, a
    script that is not there, standard input closed), or no server (or one that
    has ended), runs the real interpreter; ``-u`` before them is python's (unbuffered
    output), which is how torchrun starts its workers. The script starts its forkserver
    DataLoader workers from the server too (:func:`share_server`). This process passes the signals
    it gets on, ends with the script's status (a signal's death as that
    signal) and takes the script with it if it is killed.
    """
    global _CLIENT
    address = os.environ.get(ADDRESS_VARIABLE)
    # `-u` first: how torchrun starts each worker (`$PYTHON_EXEC -u SCRIPT ...`, see
    # torchrun_warm_env). The script's standard output and error are then unbuffered.
    unbuffered = bool(args) and args[0] == "-u"
    rest = args[1:] if unbuffered else args
    if rest and rest[0] in ("-m", "-c"):
        runnable = len(rest) >= 2
    else:  # a script that is there; python's own words for one that is not
        runnable = bool(rest) and not rest[0].startswith("-") and os.path.isfile(rest[0])
    try:
        os.fstat(0)
    except OSError:  # standard input closed: python's sys.stdin is None, the real one's job
        runnable = False
    if not address or not runnable or not os.path.exists(address):
        os.execv(sys.executable, [sys.executable, *args])
    server = mp.forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    _, server._forkserver_alive_fd = os.pipe()  # the child's own, should it start processes
    server.ensure_running = mp.resource_tracker.ensure_running  # type: ignore[attr-defined]
    _CLIENT = True
    try:
        process = warm_popen([sys.executable, *rest], stdin=0, end_with_caller=True,
                             unbuffered=unbuffered, share=True)  # fmt: skip
    except OSError:  # the server has ended (its socket file may stay): nothing was sent
        os.execv(sys.executable, [sys.executable, *args])
    for sig in _SIGNALS:
        signal.signal(sig, lambda sig, _: process.send_signal(sig))
    code = process.wait()
    if code < 0:  # died of a signal: so does python for the shell
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
