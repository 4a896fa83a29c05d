"""Start a model from published weights and train only its head, as the recipe does.

``load_pretrained`` reads a local weights file (Cadene's
``se_resnext101_32x4d-3b2fe3d8.pth``, a timm ``.pth``, or a ddpkit checkpoint)
with ``weights_only=True`` and copies every tensor whose name and shape match;
the 1000-class ImageNet head, whose shape differs from a new head's, stays
newly initialised. ``freeze_backbone`` then leaves only the classifier
trainable. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint.restore import check_extra
from ddpkit.checkpoint.serialization import load_checkpoint
from ddpkit.checkpoint.sync import extra_of

__all__ = ["PretrainedReport", "freeze_backbone", "load_pretrained"]

logger = logging.getLogger("ddpkit")

# Where a model keeps its classifier when it has no timm get_classifier():
# Cadene's pretrainedmodels (last_linear), torchvision ResNets (fc) and others.
_HEAD_NAMES = ("last_linear", "fc", "classifier", "head")
# Prefixes that wrappers add to parameter names: DDP / DataParallel and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_REPR_NAMES = 5  # PretrainedReport's repr lists a field's names up to this many, else counts


@dataclass(frozen=True)
class PretrainedReport:
    """What :func:`load_pretrained` did, as lists of parameter and buffer names.

    Attributes:
        loaded: copied from the file.
        skipped: in the file with a shape that differs from the model's (a new head).
        missing: the model's that the file did not provide; they keep their
            fresh initialisation.
    """

    loaded: list[str]
    skipped: list[str]
    missing: list[str]

    def __repr__(self) -> str:
        # A backbone has hundreds of names: a count says enough, a few names say more.
        parts = (f"{name}={_few(getattr(self, name))}" for name in ("loaded", "skipped", "missing"))
        return f"PretrainedReport({', '.join(parts)})"


def _few(names: list[str]) -> str:
    return repr(names) if 0 < len(names) <= _REPR_NAMES else str(len(names))


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    expected_extra: Mapping[str, Any] | None = None,
) -> PretrainedReport:
    """Copy the matching weights of a local file into ``model``; a differently sized head is kept.

    The file is read with ``torch.load(weights_only=True)``: a bare state dict,
    or a checkpoint dict with a ``"model"`` or ``"state_dict"`` entry. Names
    written by DDP (``module.``) or ``torch.compile`` (``_orig_mod.``) are
    stripped. A tensor is copied when the model has a tensor of the same name
    and shape; one whose shape differs (the 1000-class ImageNet head against a
    ``num_classes`` head) is skipped and logged. Call it before ``wrap_ddp``.

    Args:
        model: the freshly built model (not yet wrapped).
        path: the weights file.
        strict: also fail when the file leaves any of the model's tensors
            unset or has tensors the model lacks (shape-skipped ones excepted).
        expected_extra: refuse, before loading, a file whose run recorded another
            value for one of these keys (``CheckpointManager(extra=...)``, e.g. the
            architecture): a checkpoint's own ``extra``, or for a weight file
            (``best.pth``) that of the ``latest.pth`` beside it.

    Returns:
        A :class:`PretrainedReport` of the loaded, skipped and missing names.

    Raises:
        FileNotFoundError: no file at ``path``.
        ddpkit.CheckpointError: the file is damaged or not ``weights_only``-safe, or its
            run recorded another value for a key of ``expected_extra``.
        ValueError: the file holds no tensors, none of its names match the
            model (another architecture), or, with ``strict``, some do not.

    Example:
        >>> model = timm.create_model("legacy_seresnext101_32x4d", num_classes=10)
        >>> report = load_pretrained(model, "se_resnext101_32x4d-3b2fe3d8.pth")
        >>> report.skipped  # the ImageNet head
        ['last_linear.weight', 'last_linear.bias']
    """
    raw = load_checkpoint(path)
    if expected_extra:
        saved = raw.get("extra")
        if not isinstance(saved, dict):  # a weight file: its run's record lies beside it
            saved = extra_of(Path(path).parent / "latest.pth")
        unchecked = [k for k in expected_extra if k not in (saved or {})]
        if unchecked:
            logger.warning(
                "load_pretrained: %s has no record of %s (no readable checkpoint of its run "
                "beside it): not compared",
                path,
                ", ".join(unchecked),
            )
        check_extra(str(path), saved or {}, expected_extra)
    state = _state_dict_of(raw, path)
    own = model.state_dict()
    known = {n: t for n, t in state.items() if n in own}
    matched = {n: t for n, t in known.items() if t.shape == own[n].shape}
    skipped = [n for n in known if n not in matched]
    loaded = list(matched)
    unexpected = [n for n in state if n not in own]
    # BatchNorm's num_batches_tracked is a scalar in every architecture: it matches anything.
    if not any(not n.endswith("num_batches_tracked") for n in matched):
        raise ValueError(
            f"load_pretrained: none of the {len(state)} tensors in {path} fits the model "
            f"(file: {_sample(state)}; model: {_sample(own)}): the file is for another "
            "architecture; pass the weights of the model you build (--arch)"
        )
    missing = [n for n in own if n not in matched and n not in skipped]
    if strict and (missing or unexpected):
        raise ValueError(
            f"load_pretrained(strict=True): {path} leaves {len(missing)} of the model's tensors "
            f"unset ({_sample(missing)}) and has {len(unexpected)} the model lacks "
            f"({_sample(unexpected)}); pass strict=False to start those from scratch"
        )
    model.load_state_dict(matched, strict=False)
    if len(loaded) < len(own) // 2:
        logger.warning(
            "load_pretrained: only %d of the model's %d tensors came from %s; is it the "
            "weights of this architecture?",
            len(loaded),
            len(own),
            path,
        )
    logger.info(
        "loaded %d tensors from %s; newly initialised: %s; skipped (shape differs): %s",
        len(loaded),
        path,
        _sample(missing) if missing else "nothing",
        _sample(skipped) if skipped else "nothing",
    )
    return PretrainedReport(loaded, skipped, missing)


def freeze_backbone(model: nn.Module) -> list[str]:
    """Freeze every parameter except the classifier's, as the recipe does without --requires-grad.

    The classifier is timm's ``model.get_classifier()`` when the model has it
    (``last_linear`` for the legacy SE-ResNeXt), otherwise the first of the
    attributes ``last_linear``, ``fc``, ``classifier`` and ``head``. BatchNorm
    layers keep updating their running statistics in training mode; call
    ``model.eval()`` on the backbone as well if they should stay fixed.

    Args:
        model: the model (not yet wrapped in DDP: DDP records which
            parameters need gradients when it is built).

    Returns:
        The names of the parameters left trainable.

    Raises:
        ValueError: the model has no classifier ddpkit can find, or it has no parameters.

    Example:
        >>> freeze_backbone(model)
        ['last_linear.weight', 'last_linear.bias']
        >>> optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    """
    head = _classifier(model)
    head_params = {id(p) for p in head.parameters()}
    if not head_params:
        raise ValueError(
            f"freeze_backbone: the classifier {type(head).__name__} has no parameters; "
            "build the model with num_classes > 0"
        )
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad = id(param) in head_params
        if param.requires_grad:
            trainable.append(name)
    return trainable


def _classifier(model: nn.Module) -> nn.Module:
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        head = get_classifier()
        if isinstance(head, nn.Module):
            return head
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(
        f"freeze_backbone: {type(model).__name__} has no get_classifier() and none of the "
        f"attributes {', '.join(_HEAD_NAMES)}; set requires_grad on its parameters yourself"
    )


def _state_dict_of(
    obj: Mapping[str, object], path: str | os.PathLike[str]
) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict"):
        inner = obj.get(key)
        if isinstance(inner, Mapping):
            obj = inner
            break
    state: dict[str, torch.Tensor] = {}
    for name, value in obj.items():
        if isinstance(value, torch.Tensor):
            for prefix in _WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            state[name] = value
    if not state:
        raise ValueError(
            f"load_pretrained: {path} holds no tensors (keys: {_sample(list(obj))}); "
            "pass a state dict, or a checkpoint with a 'model' or 'state_dict' entry"
        )
    return state


def _sample(names: Mapping[str, object] | list[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:3])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > 3 else shown or "none"
