"""``fit``'s training epoch from any position, through the guard's one step.

``fit`` builds a :class:`Run` once (the :class:`TrainingState` bag, the
:class:`~ddpkit.training.guard.StepGuard`, how each step runs) and calls
:func:`train_epoch` per epoch. The epoch's batches come from the guard (the
rest of a resumed epoch, counted as they are read); each micro-batch is the
model's forward in :meth:`StepGuard.forward` and :meth:`StepGuard.backward`,
the step a loop of your own takes too (the optimizer step, the position, the
one question whether to save or stop). Around it ``fit`` keeps the epoch's
totals, the progress bar, the finite-loss check and the step callbacks.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit._docs import see
from ddpkit.checkpoint.state import TrainingState
from ddpkit.data import gpu_decode
from ddpkit.data.resume import EpochBatches
from ddpkit.distributed import comm
from ddpkit.distributed.compression import comm_hook_of
from ddpkit.training.config import TrainConfig
from ddpkit.training.evaluation import Criterion, to_device
from ddpkit.training.guard import StepGuard
from ddpkit.training.profiling import peak_memory_mb
from ddpkit.training.reporting import Reporter
from ddpkit.training.stragglers import find_straggler, gather_timings

__all__ = ["Run", "TrainingError", "train_epoch"]

logger = logging.getLogger("ddpkit")

# How often (in optimizer steps) rank 0 refreshes the progress bar; each
# refresh reads the running loss from the device, a host sync.
_REFRESH_STEPS = 20
# How many losses the non-finite check examines together, in a few kernels.
_FINITE_BATCH = 32


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message names the epoch and step."""


@dataclass
class Run:
    """What one ``fit`` call trains: the state (the guard's), and how each step runs.

    ``guard`` is the public :class:`StepGuard` a loop of your own uses too: the
    step, the one question after it, the watchdog; nothing here copies state.
    """

    state: TrainingState
    criterion: Criterion
    config: TrainConfig
    device: torch.device
    guard: StepGuard
    reporter: Reporter
    profiler: Any = None  # a StepProfiler on the ranks that profile, else None
    step_callbacks: Sequence[Callable[[dict[str, Any]], None]] = ()


def train_epoch(
    run: Run, loader: Iterable[Any], epoch: int, epochs: int, carried: Any
) -> dict[str, Any]:
    """Train ``epoch`` from where the guard's resumed position stands; return the epoch's record.

    ``carried`` is this rank's running totals saved with that position (or
    None). Each micro-batch goes through the guard's step (its epoch's last
    too, however the epoch ends).

    Raises:
        Preempted: a stop signal: every rank stopped after the same step, saved.
        CheckpointError: a background checkpoint write failed on some rank.
        TrainingError: a non-finite loss, or an epoch with no step on any rank.
    """
    guard = run.guard
    part = guard.batches(loader, epoch)
    state, config, dev = run.state, run.config, run.device
    # decode="cuda": batches decode on the device; what fell back to the CPU is counted.
    on_gpu = getattr(getattr(loader, "dataset", None), "decode", None) == "cuda"
    cpu_before = gpu_decode.cpu_decoded()
    state.model.train()
    split = [comm.get_world_size(), getattr(loader, "batch_size", None) or 0, config.grad_accum]
    totals = _Totals.carried_over(carried or {}, dev, split)
    traffic = comm_hook_of(state.model)  # what each step all-reduces (wrap_ddp's models)
    sent = traffic.counted() if traffic is not None else (0, 0)
    if dev.type == "cuda":  # the record's peak memory is this epoch's
        torch.cuda.reset_peak_memory_stats(dev)
    progress = _Progress(run.reporter, part.total, part.done, epoch, epochs, dev)
    rate = state.optimizer.param_groups[0]["lr"]
    part.batches = totals.timed(iter(part.batches))  # the time spent waiting for data
    for images, targets in part:
        batch = part.done - 1  # the index in the epoch of this micro-batch
        images, targets = to_device(images, targets, dev, config.normalize)
        if config.channels_last and images.dim() == 4:
            images = images.contiguous(memory_format=torch.channels_last)
        if config.batch_transform is not None:
            images, targets = config.batch_transform(images, targets)
        with guard.forward(part):
            loss = run.criterion(state.model(images), targets)
        held = loss.detach()
        totals.add(held, targets.shape[0])  # before the step: a step checkpoint counts it
        progress.finite.add(batch, held)
        used = state.optimizer.param_groups[0]["lr"]  # the rate a step now uses
        if guard.backward(loss, part, loop=totals.as_loop):
            rate = used
            _stepped(run, part, held, rate)
        progress.show(batch, part.last, totals)
    # Up to the next epoch's first batch (the totals' all-reduce, then fit's validation, report,
    # callbacks and checkpoint) the rank is at the epoch's end, which the watchdog orders after
    # the epoch's steps and before the next epoch's, at one and the same step count.
    run.guard.progress("epoch_end")
    seconds = totals.seconds()
    progress.close(epoch)
    decoded = gpu_decode.cpu_decoded() - cpu_before if on_gpu else None
    record = totals.record(epoch, rate, seconds, dev, part.dropped, decoded)
    if record["train_samples"] == 0:  # the same on every rank: summed in the record
        dropped = record.get("rank_dropped_batches") or []
        empty = [r for r, n in enumerate(dropped) if n == 0] if any(dropped) else "every rank"
        raise TrainingError(
            f"epoch {epoch + 1} trained no step: the training loader yielded no batch on "
            f"{empty if isinstance(empty, str) else f'rank(s) {empty}'}, and the ranks end an "
            "epoch together. Check that every rank's data (its shards) is there"
        )
    if traffic is not None:
        record["comm_hook"] = traffic.kind or "none"
        record["comm_bytes_per_step"] = traffic.bytes_per_step(sent)
    return record | {"peak_memory_mb": totals.peak_mb}


def _stepped(run: Run, part: EpochBatches, loss: torch.Tensor, rate: float) -> None:
    """After an optimizer step of ``fit``: the profiler's step, then the step callbacks."""
    if run.profiler is not None:
        run.profiler.at(run.guard.step)
    if run.step_callbacks:
        info = {
            "epoch": part.epoch + 1,  # counted from 1, as the epoch lines are
            "step": run.guard.step,
            "batch": part.done,
            "lr": float(rate),
            "loss": loss,
            "position": run.state.position,
        }
        for callback in run.step_callbacks:
            callback(info)


class _Totals:
    """This rank's running sums over the epoch: the loss, the samples, the time and its wait.

    Carried into a step checkpoint (:meth:`as_loop`) and back out of one
    (:meth:`carried_over`), so a resumed epoch reports what an unbroken one would.
    """

    def __init__(
        self,
        loss_sum: torch.Tensor,
        samples: int,
        before: float,
        waited: float,
        splits: list[list[int]] | None = None,
    ) -> None:
        self.loss_sum, self.samples, self.before, self.waited = loss_sum, samples, before, waited
        self.began = time.perf_counter()
        self.peak_mb = 0.0
        # How each step's samples were split, [world size, per-process batch, accumulation],
        # one entry per change within the epoch (a server left or joined).
        self.splits = splits or []

    @classmethod
    def carried_over(cls, carried: dict[str, Any], dev: torch.device, split: list[int]) -> _Totals:
        loss_sum = torch.full(
            (), float(carried.get("loss_sum", 0.0)), dtype=torch.float64, device=dev
        )
        splits = [list(map(int, s)) for s in carried.get("splits") or []]
        if not splits or splits[-1] != split:
            splits.append(split)
        return cls(
            loss_sum,
            int(carried.get("samples", 0)),
            float(carried.get("seconds", 0.0)),
            float(carried.get("data_seconds", 0.0)),
            splits,
        )

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, with the time spent waiting for each one added up."""
        while True:
            asked = time.perf_counter()
            try:
                item = next(batches)
            except StopIteration:
                return
            self.waited += time.perf_counter() - asked
            yield item

    def add(self, loss: torch.Tensor, size: int) -> None:
        # One kernel. A float32 loss times a count is exact in float64: the same sum as
        # adding ``loss.double() * size``.
        self.loss_sum.add_(loss, alpha=size)
        self.samples += size

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.began

    def as_loop(self) -> dict[str, Any]:
        """What a step checkpoint stores of this rank's epoch so far (one host sync)."""
        return {
            "loss_sum": float(self.loss_sum.item()),
            "samples": self.samples,
            "data_seconds": self.waited,
            "seconds": self.seconds(),
            "splits": self.splits,
        }

    def record(
        self,
        epoch: int,
        rate: float,
        seconds: float,
        dev: torch.device,
        dropped: int = 0,
        cpu_decoded: int | None = None,
    ) -> dict[str, Any]:
        """The epoch's record, summed over the ranks. All ranks must call this, or it deadlocks.

        ``dropped``: batches this rank's loader held beyond the epoch's agreed end.
        ``cpu_decoded``: (``decode="cuda"``) images this rank decoded on the CPU,
        summed into the record's ``cpu_decoded`` in the same all-reduce.
        """
        counts = [float(self.samples), self.waited, seconds, float(cpu_decoded or 0)]
        total = comm.all_reduce_sum(
            torch.cat([self.loss_sum[None], torch.tensor(counts, device=dev, dtype=torch.float64)])
        )
        global_samples = int(total[1].item())
        self.peak_mb = peak_memory_mb(dev)
        ranks = _ranks_apart(self.waited, seconds, self.peak_mb, dropped)
        if ranks:
            self.peak_mb = max(ranks.pop("rank_peak_mb"))
        if cpu_decoded is not None:  # the same on every rank: decode="cuda"
            ranks["cpu_decoded"] = int(total[4].item())
        return ranks | {
            "epoch": epoch + 1,  # what a person reads counts from 1: the bar, lines, files
            "train_loss": float(total[0].item()) / max(global_samples, 1),
            "train_samples": global_samples,
            "world_sizes": [split[0] for split in self.splits],  # a server left or joined: more
            "batch_splits": self.splits,
            "train_images_per_sec": global_samples / max(seconds, 1e-9),
            "lr": float(rate),  # of the epoch's last step
            "seconds": seconds,
            "data_wait": float(total[2].item()) / max(float(total[3].item()), 1e-9),
        }


def _ranks_apart(waited: float, seconds: float, peak_mb: float, dropped: int) -> dict[str, Any]:
    """Each rank's data wait and compute, their spread, the straggler: one gather per epoch.

    With ``rank_dropped_batches`` when a rank's data went on past the epoch's
    agreed end. Nothing (and no collective) in a single process, where a
    batch beyond the loader's length (one that says too few) is only logged.
    All ranks must call this, or it deadlocks.
    """
    if comm.get_world_size() < 2:
        if dropped:
            logger.warning(
                "the training loader yielded %d batch(es) beyond its length; they were "
                "not trained on",
                dropped,
            )
        return {}
    timings = gather_timings(waited, seconds, peak_mb, dropped)
    totals = [t["data_s"] + t["compute_s"] for t in timings]
    middle = statistics.median(totals)
    apart = [t["dropped"] for t in timings]
    if any(apart) and comm.get_rank() == 0:
        logger.warning(
            "the ranks' training data ended apart: every rank stopped the epoch after the "
            "same step, and dropped %s",
            ", ".join(f"{n} batch(es) on rank {r}" for r, n in enumerate(apart) if n),
        )
    return ({"rank_dropped_batches": apart} if any(apart) else {}) | {
        "rank_data_s": [t["data_s"] for t in timings],
        "rank_compute_s": [t["compute_s"] for t in timings],
        "rank_spread": (max(totals) - min(totals)) / middle if middle > 0 else 0.0,
        "straggler": find_straggler(timings),
        "rank_peak_mb": [t["peak_mb"] for t in timings],
    }


class _Progress:
    """The epoch's progress bar (rank 0, on a terminal) and its check that the loss is finite."""

    def __init__(
        self,
        reporter: Reporter,
        total: int | None,
        done: int,
        epoch: int,
        epochs: int,
        dev: torch.device,
    ) -> None:
        self.bar = reporter.progress_bar(total, f"epoch {epoch + 1}/{epochs}")
        if self.bar is not None and done:
            self.bar.update(done)
        self.finite = _FiniteCheck(dev)
        self.epoch = epoch

    def show(self, batch: int, last: bool, totals: _Totals) -> None:
        """Refresh the bar every ``_REFRESH_STEPS`` micro-batches: each refresh syncs the host."""
        if self.bar is None or not (batch % _REFRESH_STEPS == 0 or last):
            return
        self.finite.check(self.epoch)
        loss = totals.loss_sum.item() / max(totals.samples, 1)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(batch + 1 - self.bar.n)

    def close(self, epoch: int) -> None:
        if self.bar is not None:
            self.bar.close()
        self.finite.check(epoch)


class _FiniteCheck:
    """The epoch's first micro-batch whose loss was not finite, found on the device.

    Each loss is only kept (a detached scalar); every ``_FINITE_BATCH`` of them
    are examined together in a few kernels, with no host sync, so a step adds
    no kernel launch of its own. :meth:`check` examines the rest and syncs once.
    """

    def __init__(self, device: torch.device) -> None:
        self._first = torch.full((), -1, dtype=torch.int64, device=device)
        self._losses: list[torch.Tensor] = []
        self._start = 0  # the micro-batch index of self._losses[0]

    def add(self, index: int, loss: torch.Tensor) -> None:
        """Keep the loss of micro-batch ``index`` (one more than the previous one's)."""
        if not self._losses:
            self._start = index
        self._losses.append(loss)
        if len(self._losses) == _FINITE_BATCH:
            self._examine()

    def _examine(self) -> None:
        if not self._losses:
            return
        bad = ~torch.isfinite(torch.stack(self._losses))
        self._losses.clear()
        # argmax finds the first bad one; an earlier find is kept.
        found = torch.where(bad.any(), bad.byte().argmax() + self._start, -1)
        self._first = torch.where(self._first < 0, found, self._first)

    def check(self, epoch: int) -> None:
        """Raise :class:`TrainingError` if a loss so far was not finite (one host sync).

        ``epoch`` is the epoch's index; the message counts epochs and batches from 1.
        """
        self._examine()
        bad = int(self._first.item())
        if bad < 0:
            return
        raise TrainingError(
            f"the loss was not finite (nan or inf) in epoch {epoch + 1}, batch {bad + 1} of "
            f"the epoch, on rank "
            f"{comm.get_rank()}. Lower the learning rate, train in bf16 (or fp16, which scales "
            "the loss) or check the inputs; the last checkpoint is from before this step. "
            + see("training-load_pretrained-wrap_ddp-focalloss-fit")
        )
