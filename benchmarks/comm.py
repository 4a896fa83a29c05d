"""Gradients over a slow link: step time and bytes per step with no hook, bf16 and PowerSGD.

Two ranks run in two network namespaces joined by a veth pair that ``tc``
limits on both ends (netem: ``--rate``, default 1 Gbit/s, and ``--delay``,
default 0.5 ms each way; a kernel without netem gets a token bucket at the rate
and no delay, and the first line says so), the servers of a job on one Ethernet
link. Each rank trains the same model (timm ``--arch``, default resnet18, 11.7
M parameters, 44.7 MB of fp32 gradients) on the same batches (``--batch`` 4 of
64 px per rank: CPU cores are slow, and a small batch keeps a step's compute
near a GPU's share next to a 1 Gbit/s link), wrapped by ``ddpkit.wrap_ddp``
with each hook in turn (the order rotates from round to round), and times
``--steps`` optimizer steps after ``--warmup`` (PowerSGD compresses from its
third step: ``powersgd_warmup=2``). Per hook it prints the median step time
over the rounds with their range, its ratio to no hook's (measured in the same
round, side by side), the bytes a step hands to the all-reduce (what the hook
counts, the epoch line's figure) and the bytes the rank's link sent per step
(its interface's counter: the all-reduce's traffic with TCP's framing). Goal:
with bf16 a step takes <= 0.65 of no hook's time.

Needs root, ``ip`` (iproute2) and ``tc``; without them it prints
why and skips.

    python benchmarks/comm.py [--rounds 3] [--steps 8] [--rate 1gbit] [--delay 0.5ms] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HOOKS = ("none", "bf16", "powersgd")
ADDRESSES = ("198.18.7.1", "198.18.7.2")


def worker(args: argparse.Namespace) -> None:
    """One rank: each hook in the round's order, its steps timed; rank 0 prints JSON."""
    import timm
    import torch
    from torch import nn

    import ddpkit

    torch.set_num_threads(1)
    info = ddpkit.init_distributed(
        init_method=f"tcp://{ADDRESSES[0]}:29731", world_size=2, rank=args.rank
    )
    counter = Path(f"/sys/class/net/{args.link}/statistics/tx_bytes")
    g = torch.Generator().manual_seed(args.rank)
    size = args.image_size
    batches = [
        (torch.randn(args.batch, 3, size, size, generator=g), torch.randint(0, 10, (args.batch,)))
        for _ in range(4)
    ]
    results: dict[str, Any] = {}
    for hook in args.order.split(","):
        torch.manual_seed(0)
        net = timm.create_model(args.arch, num_classes=10)
        extra: dict[str, Any] = {"powersgd_warmup": 2} if hook == "powersgd" else {}
        model = ddpkit.wrap_ddp(net, comm_hook=None if hook == "none" else hook, **extra)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        traffic = ddpkit.comm_hook_of(model)
        assert traffic is not None

        def step(i: int, model: nn.Module = model, optimizer: Any = optimizer) -> None:
            x, y = batches[i % len(batches)]
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for i in range(args.warmup):
            step(i)
        ddpkit.barrier()
        sent, wire = traffic.counted(), int(counter.read_text())
        times = []
        for i in range(args.steps):
            began = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - began)
        wire = int(counter.read_text()) - wire
        ddpkit.barrier()
        results[hook] = {
            "step_s": statistics.median(times),
            "bytes": traffic.bytes_per_step(sent),
            "wire": wire / args.steps,
        }
    if info.is_main:
        print("RESULT " + json.dumps(results), flush=True)
    ddpkit.shutdown(info)


def _missing() -> str | None:
    """Why this machine cannot make the link, or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root to make network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) to make and limit the link"
    probe = f"dkb-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _link(tag: str, rate: str, delay: str) -> tuple[list[str], list[str], str]:
    """Two namespaces on a veth pair limited to ``rate`` (and ``delay``, with netem)."""
    spaces, links = _spaces(tag), [f"dkb{tag}a", f"dkb{tag}b"]
    shaped = f"tc netem: {rate}, {delay} each way"
    for name in spaces:
        _run("ip", "netns", "add", name)
    _run("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
    for name, link, address in zip(spaces, links, ADDRESSES, strict=True):
        _run("ip", "link", "set", link, "netns", name)
        _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link)
        _run("ip", "-n", name, "link", "set", link, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        qdisc = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", link, "root"]
        try:  # a queue long enough for a bucket's burst: the rate limits, it does not drop
            _run(*qdisc, "netem", "delay", delay, "rate", rate, "limit", "100000")
        except RuntimeError as exc:
            if "unknown" not in str(exc):
                raise
            # A kernel without sch_netem: a token bucket limits the rate; no delay is added.
            _run(*qdisc, "tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
            shaped = f"tc tbf: {rate} (this kernel has no netem, so no added delay)"
    return spaces, links, shaped


def _spaces(tag: str) -> list[str]:
    return [f"dkb-{tag}-a", f"dkb-{tag}-b"]


def _command(args: argparse.Namespace, rank: int, space: str, link: str, order: str) -> list[str]:
    """One rank's command, inside its namespace."""
    flags = {"--rank": rank, "--link": link, "--order": order, "--arch": args.arch,
             "--batch": args.batch, "--image-size": args.image_size, "--steps": args.steps,
             "--warmup": args.warmup}  # fmt: skip
    given = [text for flag, value in flags.items() for text in (flag, str(value))]
    return ["ip", "netns", "exec", space, sys.executable, __file__, "--worker", *given]


def _round(args: argparse.Namespace, spaces: list[str], links: list[str], order: str) -> Any:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            _command(args, r, name, link, order),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, (name, link) in enumerate(zip(spaces, links, strict=True))
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed (status {p.returncode}):\n{out[-3000:]}")
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", default="0.5ms")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--link", help=argparse.SUPPRESS)
    parser.add_argument("--order", default=",".join(HOOKS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    reason = _missing()
    if reason is not None:
        print(f"benchmarks/comm.py skipped: {reason}")
        return
    tag, rounds = uuid.uuid4().hex[:6], []
    try:
        spaces, links, shaped = _link(tag, args.rate, args.delay)
        print(
            f"2 ranks in two network namespaces on one veth pair, {shaped}; {args.arch}, "
            f"batch {args.batch} of {args.image_size} px per rank; {args.steps} timed steps "
            f"after {args.warmup}, {args.rounds} rounds",
            flush=True,
        )
        for r in range(args.rounds):
            order = ",".join(HOOKS[r % 3 :] + HOOKS[: r % 3])
            rounds.append(_round(args, spaces, links, order))
            shown = ", ".join(f"{h} {rounds[-1][h]['step_s']:.3f} s" for h in HOOKS)
            print(f"round {r + 1}: {shown}", flush=True)
    finally:
        for name in _spaces(tag):  # deleting a namespace deletes its end of the link
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    print("\n| hook | step s (median, range) | / no hook (median, range) ", end="")
    print("| all-reduce MB/step | link MB/step |")
    print("| --- | --- | --- | --- | --- |")
    for hook in HOOKS:
        times = [r[hook]["step_s"] for r in rounds]
        ratios = [r[hook]["step_s"] / r["none"]["step_s"] for r in rounds]
        print(
            f"| {hook} | {statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {rounds[-1][hook]['bytes'] / 1e6:.3g} "
            f"| {statistics.median(r[hook]['wire'] for r in rounds) / 1e6:.3g} |"
        )
    bf16 = statistics.median(r["bf16"]["step_s"] / r["none"]["step_s"] for r in rounds)
    verdict = "met" if bf16 <= 0.65 else "MISSED"
    print(f"\ngoal: bf16 step time <= 0.65 of no hook's: {bf16:.2f}, {verdict}")


if __name__ == "__main__":
    main()
