"""What ``fit`` shows and writes on rank 0: progress bars, ``metrics.jsonl``, TensorBoard, logs.

``fit`` hands each epoch's record to a :class:`Reporter` and asks it for a
progress bar; nothing about how a result is shown lives in the training loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ReportConfig", "Reporter"]

logger = logging.getLogger("ddpkit")

_SUMMARY_KEYS = ("train_loss", "val_acc1", "val_acc5", "val_loss", "train_images_per_sec")


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """What :func:`ddpkit.fit` shows and writes; all of it on rank 0 only.

    Attributes:
        progress: a tqdm progress bar for each epoch.
        log_dir: write ``metrics.jsonl`` (one JSON line per epoch) here, and
            TensorBoard events when ``tensorboard`` is installed; None: neither.
    """

    progress: bool = True
    log_dir: str | os.PathLike[str] | None = None


class Reporter:
    """Rank 0's view of a run: bars, one JSON line and one log line per epoch.

    On other ranks (``is_main=False``) every method does nothing, so the
    training loop calls them unconditionally.
    """

    def __init__(self, config: ReportConfig, *, is_main: bool) -> None:
        self.config, self.is_main = config, is_main
        self._jsonl: Any = None
        self._tb: Any = None
        if is_main and config.log_dir is not None:
            os.makedirs(config.log_dir, exist_ok=True)
            path = os.path.join(config.log_dir, "metrics.jsonl")
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.fspath(config.log_dir))
            except ImportError:
                pass

    def progress_bar(self, total: int | None, desc: str) -> Any:
        """A tqdm bar on rank 0 with ``progress``, else None."""
        if not (self.config.progress and self.is_main):
            return None
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)

    def epoch(self, record: dict[str, Any]) -> None:
        """Write one epoch's record: a JSON line, TensorBoard scalars, a log line."""
        if not self.is_main:
            return
        if self._jsonl is not None:
            clean = {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in record.items()
            }
            self._jsonl.write(json.dumps(clean) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "epoch":
                    self._tb.add_scalar(key, value, record["epoch"])
            self._tb.flush()
        shown = ", ".join(f"{k} {record[k]:.4g}" for k in _SUMMARY_KEYS if k in record)
        logger.info("epoch %d: %s", record["epoch"], shown)

    def close(self) -> None:
        """Close the files; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
