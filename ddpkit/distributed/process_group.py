"""Start and stop a distributed job: ``init_distributed``, ``join_job``, ``shutdown``.

``init_distributed`` is a straight line: read the launcher (``launchers``),
resolve the job (``job``), pick the device (``devices``), plan and apply the
network (``network``), join the other ranks (``rendezvous``), then create the
process group on that store with a short connect timeout before switching
to the collective one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._docs import see
from ddpkit.distributed import devices
from ddpkit.distributed.comm import destroy_group
from ddpkit.distributed.job import DistInfo, JobPlan, as_timeout, resolve_job, restore_environ
from ddpkit.distributed.launchers import detect_launcher, master_endpoint
from ddpkit.distributed.membership import elastic_warnings, find_agent
from ddpkit.distributed.network import plan_network
from ddpkit.distributed.recorder import enable_recorder
from ddpkit.distributed.rendezvous import RendezvousError, join, open_store

__all__ = ["init_distributed", "join_job", "shutdown"]

logger = logging.getLogger("ddpkit")


def shutdown(info: DistInfo | None = None) -> None:
    """Destroy the default process group if there is one; safe to call twice.

    Call it on every rank when training ends, and in ``finally``, so that a
    rank that fails leaves the group at once: the other ranks' next
    collective then fails quickly instead of waiting for the collective
    timeout. ``with init_distributed() as info:`` calls it for you.

    Args:
        info: the :class:`DistInfo` of the job; given, the environment
            variables ``init_distributed`` set (NCCL/Gloo network variables)
            are put back as well.
    """
    destroy_group()
    if info is not None:
        info.restore_environment()


def init_distributed(
    init_method: str | None = None,
    backend: str = "auto",
    *,
    world_size: int | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    timeout: timedelta = timedelta(minutes=30),
    rendezvous_timeout: timedelta = timedelta(seconds=120),
    device: str | torch.device | None = None,
    network: str | None = "auto",
) -> DistInfo:
    """Join the job this process belongs to, or describe a single process.

    With no arguments the launcher is detected from the environment (torchrun,
    SLURM, Open MPI); without any, this is a plain single process: no process
    group is created and ``DistInfo.is_distributed`` is False, so one script
    runs anywhere.

    Args:
        init_method: ``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``),
            ``"tcp://host:port"`` or ``"file:///shared/path"``; None: from the
            launcher.
        backend: ``"auto"`` (NCCL with CUDA, else Gloo), ``"nccl"``, ``"gloo"``.
        world_size: number of processes; default from the launcher.
        rank: global rank; default from the launcher.
        local_rank: rank on this node; default from the launcher, else worked
            out from which ranks share this host.
        timeout: collective timeout once the group is up (a ``timedelta``, or
            a number of seconds).
        rendezvous_timeout: how long to wait for all ranks to join. Kept short
            so a misconfigured job fails in minutes, not after ``timeout``.
        device: ``"cpu"``, ``"cuda"`` (``cuda:local_rank``) or an explicit
            device; default ``cuda:local_rank`` when CUDA is available.
        network: ``"auto"`` runs :func:`ddpkit.configure_network` with the
            interface that routes to the master; an interface name uses that
            one; None leaves the network variables alone.

    The flight recorder of collectives is turned on for the group (a ring of
    the last 200 per process, Gloo and NCCL) and, with NCCL, its dump on a
    collective timeout and the error handling that ends a timed-out rank,
    unless those variables are set (:mod:`ddpkit.distributed.recorder`). The
    environment is put back by ``DistInfo.restore_environment``.

    Returns:
        A frozen :class:`DistInfo`.

    Raises:
        RendezvousError: the ranks did not all join within
            ``rendezvous_timeout``, a rank joined twice, the ranks disagree on
            the world size, or the port is taken. The message names them.
        ValueError: an argument of the wrong kind or out of range (a timeout of
            0, a backend that does not exist ...), inconsistent arguments, or
            NCCL without CUDA; the message names the argument.

    Example:
        >>> with init_distributed() as info:
        ...     model = wrap_ddp(model)  # trains on info.device
    """
    timeout = as_timeout("timeout", timeout)
    rendezvous_timeout = as_timeout("rendezvous_timeout", rendezvous_timeout)
    _check_names(init_method, backend, network, device)
    if dist.is_available() and dist.is_initialized():
        warnings.warn(
            "init_distributed: a process group already exists; returning its description "
            "(call ddpkit.shutdown() first to start a new one)",
            RuntimeWarning,
            stacklevel=2,
        )
        return _describe_existing()

    launch = detect_launcher()
    endpoint = None
    if launch is not None or (init_method or "").startswith("env:"):
        endpoint = master_endpoint(launch=launch)
    plan = resolve_job(
        init_method,
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        launch=launch,
        endpoint=endpoint,
    )
    if plan is None:
        dev = devices.pick_device(device, 0, backend)
        devices.check_backend(devices.resolve_backend(backend, dev), dev)
        return DistInfo(0, 0, 1, 1, 0, dev, None, False)
    return join_job(
        plan,
        backend=backend,
        device=device,
        network=network,
        timeout=timeout,
        rendezvous_timeout=rendezvous_timeout,
    )


def _check_names(init_method: object, backend: object, network: object, device: object) -> None:
    """Refuse an init method, backend, network or device of the wrong kind before any work."""
    if init_method is not None and not isinstance(init_method, str):
        raise ValueError(
            f"init_method must be a string such as 'tcp://host:port', got {init_method!r}"
        )
    devices.resolve_backend(backend, torch.device("cpu"))  # type: ignore[arg-type]
    if device is not None:
        devices.as_device(device)  # type: ignore[arg-type]
    if network is not None and not isinstance(network, str):
        raise ValueError(
            f"network must be 'auto', an interface name such as 'eth0', or None; got {network!r}"
        )


def join_job(
    plan: JobPlan,
    *,
    backend: str = "auto",
    device: str | torch.device | None = None,
    network: str | None = "auto",
    timeout: timedelta = timedelta(minutes=30),
    rendezvous_timeout: timedelta = timedelta(seconds=120),
) -> DistInfo:
    """Join the job ``plan`` describes: device, network, rendezvous, process group.

    ``init_distributed`` after :func:`ddpkit.distributed.job.resolve_job`; ``spawn``'s
    children call it with the plan their parent resolved. Arguments as for
    :func:`init_distributed`. If anything fails, the environment is put back.
    """
    dev = devices.pick_device(device, plan.local_rank or 0, backend)
    resolved = devices.resolve_backend(backend, dev)
    devices.check_backend(resolved, dev)
    before: tuple[tuple[str, str | None], ...] = ()
    try:
        if network is not None:
            net = plan_network(
                socket_ifname=network, master_addr=plan.master_addr, backend=resolved
            )
            before = tuple((s.name, s.previous) for s in net.changes)
            # One line per setting per node, not per rank: the node's first rank says it.
            first = plan.local_rank if plan.local_rank is not None else plan.rank
            net.apply(log=first == 0)
        # The recorder of collectives, for the hang report: torch reads it at group creation.
        before += enable_recorder(resolved)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        deadline = time.monotonic() + rendezvous_timeout.total_seconds()
        store = open_store(plan, rendezvous_timeout)
        layout = join(store, plan, deadline)
        local_rank = plan.local_rank if plan.local_rank is not None else layout.local_rank
        if dev.type == "cuda" and plan.local_rank is None and device is None:
            # Only now is it known which GPU this rank takes on its host.
            dev = devices.pick_device(None, local_rank, backend)
            torch.cuda.set_device(dev)
        _init_process_group(store, plan, resolved, dev, timeout, rendezvous_timeout)
    except BaseException:
        restore_environ(before)
        raise
    info = DistInfo(
        rank=plan.rank,
        local_rank=local_rank,
        world_size=plan.world_size,
        local_world_size=plan.local_world_size or layout.local_world_size,
        node_rank=plan.node_rank if plan.node_rank is not None else layout.node_rank,
        device=dev,
        backend=resolved,
        is_distributed=True,
        launcher=plan.launcher,
        init_method=plan.url,
        restart_count=plan.restart_count,
        environ_before=before,
    )
    logger.info(
        "rank %d/%d (node %d, local rank %d) joined %s with %s on %s",
        info.rank,
        info.world_size,
        info.node_rank,
        info.local_rank,
        info.init_method,
        info.backend,
        info.device,
    )
    if info.local_rank == 0:  # what would break a server's join, once per server
        for line in elastic_warnings(detect_launcher(), find_agent()):
            logger.warning(line)
    return info


def _init_process_group(
    store: dist.Store,
    plan: JobPlan,
    backend: str,
    dev: torch.device,
    timeout: timedelta,
    rendezvous_timeout: timedelta,
) -> None:
    set_timeout = getattr(dist, "set_timeout", None) or getattr(
        dist.distributed_c10d, "_set_pg_timeout", None
    )
    # Connect with the short timeout so a wrong interface fails in minutes,
    # then switch to the collective timeout the caller asked for.
    first_timeout = min(timeout, rendezvous_timeout) if set_timeout else timeout
    kwargs: dict[str, Any] = {}
    if dev.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = dev
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(plan.store_prefix + "/pg", store),
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=first_timeout,
            **kwargs,
        )
        # Connects every pair now, inside this error handling. Gloo connects while the group
        # is created, but that is no synchronisation point: without it a rank that ends
        # before any collective could close its side while a peer still connects to it,
        # and that peer fails with "Connection closed by peer" (pytorch/pytorch#61396).
        if backend == "nccl":
            dist.barrier(device_ids=[dev.index])
        elif plan.world_size > 1:  # alone, there is nothing to connect
            dist.barrier()
    except Exception as exc:
        shutdown()
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise RendezvousError(
            f"all {plan.world_size} ranks joined {plan.url}, but the {backend} backend could "
            f"not connect them: {first}. The backend uses other ports and interfaces than the "
            "rendezvous: check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, the firewall between "
            "the nodes and InfiniBand with `ddpkit doctor`. " + see("the-backend-cannot-connect")
        ) from exc
    if set_timeout is not None and first_timeout != timeout:
        set_timeout(timeout)
    store.set_timeout(timeout)
    # A process that leaves without the with-block (a return, sys.exit) takes down the group
    # ddpkit set up: torch's own teardown of a live group can abort it (SIGABRT, status -6).
    atexit.unregister(_leave_at_exit)
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    """Destroy a process group still up when the interpreter exits; the status stays its own."""
    with contextlib.suppress(Exception):  # the exit goes on whatever the teardown says
        destroy_group()


def _describe_existing() -> DistInfo:
    """A process group made elsewhere: what the group and the launcher (if any) say."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        launch = detect_launcher()
    except ValueError:  # malformed launcher variables describe nothing here
        launch = None
    same_job = launch is not None and (launch.rank, launch.world_size) == (rank, world)
    return DistInfo(
        rank=rank,
        local_rank=launch.local_rank if launch and same_job else 0,
        world_size=world,
        local_world_size=launch.local_world_size if launch and same_job else world,
        node_rank=launch.node_rank if launch and same_job else 0,
        device=devices.collective_device(),
        backend=str(dist.get_backend()),
        is_distributed=True,
        launcher="existing",
        restart_count=launch.restart_count if launch and same_job else 0,
    )
