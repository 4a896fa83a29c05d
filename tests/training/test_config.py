"""The options of fit: one module of frozen, keyword-only dataclasses, a docstring per field."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import numpy as np
import pytest

import ddpkit
from ddpkit.training import config

CONFIGS = [config.TrainConfig, config.FaultConfig, config.ReportConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_each_config_is_frozen_keyword_only_and_public(cls: type) -> None:
    assert getattr(ddpkit, cls.__name__) is cls
    assert getattr(ddpkit.training, cls.__name__) is cls
    made = cls()
    field = dataclasses.fields(cls)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, field.name, getattr(made, field.name))
    with pytest.raises(TypeError):
        cls(getattr(made, field.name))  # positional: refused


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_its_own_docstring(cls: type) -> None:
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    documented = set()
    for node, after in zip(body.body, body.body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = getattr(after, "value", None)
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                assert len(doc.value.split()) >= 4, node.target.id
                documented.add(node.target.id)
    assert documented == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: config.TrainConfig(amp="fp8"), "amp"),
        (lambda: config.TrainConfig(grad_accum=0), "grad_accum"),
        (lambda: config.TrainConfig(grad_accum=True), "grad_accum"),
        (lambda: config.TrainConfig(clip_grad_norm=0.0), "clip_grad_norm"),
        (lambda: config.TrainConfig(clip_grad_norm=-1.0), "clip_grad_norm"),
        (lambda: config.TrainConfig(batch_transform=3), "batch_transform"),  # type: ignore[arg-type]
        (lambda: config.TrainConfig(normalize=((0.5,), (0.5, 0.5))), "normalize"),
        (lambda: config.FaultConfig(hang_timeout=0), "hang_timeout"),
        (lambda: config.FaultConfig(hang_timeout=-1), "hang_timeout"),
        (lambda: config.FaultConfig(hang_timeout=math.inf), "hang_timeout"),
        (lambda: config.FaultConfig(stop_signals=("SIGNOPE",)), "SIGNOPE"),
        (lambda: config.FaultConfig(on_data_change="later"), "on_data_change"),
    ],
)
def test_a_bad_value_is_named_when_the_config_is_made(make: object, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        make()  # type: ignore[operator]


def test_a_numpy_timeout_becomes_a_plain_float() -> None:
    made = config.FaultConfig(hang_timeout=np.int64(30))
    assert made.hang_timeout == 30.0
    assert type(made.hang_timeout) is float


def test_the_defaults_are_what_fit_documents() -> None:
    assert config.TrainConfig().grad_accum == 1
    assert config.TrainConfig().normalize == (ddpkit.IMAGENET_MEAN, ddpkit.IMAGENET_STD)
    assert config.FaultConfig().stop_signals == ("SIGTERM", "SIGUSR1", "SIGINT")
    assert config.FaultConfig().hang_timeout is None
    assert config.ReportConfig().progress is True
    assert config.ReportConfig().log_dir is None
