"""Checkpoints: crash-safe files, written in the background, found again on any node.

:class:`CheckpointManager` owns one run's files (``manager``): it takes the
training state once (:class:`TrainingState`, ``state``) and saves epoch and
step checkpoints, ``interrupted.pth`` on a stop, per-epoch weight files and
``best.pth``; ``cadence`` says when. Each file is written atomically with
CRCs and loads with ``torch.load(weights_only=True)`` (``serialization``); a
save copies the state to host memory and one writer thread writes it
(``background``); ``files`` names, scans and prunes a run's directory; on
resume the ranks agree on the newest complete checkpoint any of them holds
(``sync``) and send it to those that lack it (``transfer``)::

    from ddpkit.checkpoint import CheckpointManager, TrainingState

    manager = CheckpointManager("runs/exp1", every_steps=500,
                                state=TrainingState(model, optimizer, scheduler))
    start = manager.resume()                   # the newest complete checkpoint, if any
    ...  # StepGuard advances the state's progress; then the one save verb:
    manager.checkpoint("epoch", metrics={"acc1": acc1})  # the bound state, as it is

:func:`save_checkpoint` / :func:`load_checkpoint` are the single-file
primitives for a loop of your own.

This package imports ``ddpkit.distributed`` and nothing of ``ddpkit.training``
or ``ddpkit.data``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_names

if TYPE_CHECKING:  # the public names, each listed once (ddpkit._lazy)
    from ddpkit.checkpoint.manager import CheckpointManager as CheckpointManager
    from ddpkit.checkpoint.serialization import CheckpointError as CheckpointError
    from ddpkit.checkpoint.serialization import load_checkpoint as load_checkpoint
    from ddpkit.checkpoint.serialization import save_checkpoint as save_checkpoint
    from ddpkit.checkpoint.state import TrainingState as TrainingState

if not TYPE_CHECKING:  # see ddpkit._lazy: mypy must not see an __all__ it cannot read
    __getattr__, __dir__, __all__ = lazy_names(__name__, __file__)
