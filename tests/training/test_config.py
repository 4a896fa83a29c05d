"""The options of fit: one module of frozen, keyword-only dataclasses, a docstring per field."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import json
import math
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch

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


class _Mode(enum.Enum):
    FAST = "fast"


def test_run_config_becomes_plain_json_once() -> None:
    given = {
        "data": Path("/data/train"),
        "out": PurePosixPath("runs/a"),
        "mode": _Mode.FAST,
        "steps": (1, np.int64(2)),
        "lr": np.float32(0.5),
        "ema": np.bool_(True),
        "t": torch.tensor(3),
        "nested": {"seen": {3, 1}, 7: [None, "x"], _Mode.FAST: math.inf},
        "nan": math.nan,
    }
    made = config.ReportConfig(run_config=given)
    assert made.run_config == {
        "data": "/data/train",
        "out": "runs/a",
        "mode": "fast",
        "steps": [1, 2],
        "lr": 0.5,
        "ema": True,
        "t": 3,
        "nested": {"seen": [1, 3], "7": [None, "x"], "fast": "inf"},
        "nan": "nan",
    }
    assert json.loads(json.dumps(made.run_config, allow_nan=False)) == made.run_config
    given["data"] = "changed"  # a copy: the caller's dict is the caller's
    assert made.run_config["data"] == "/data/train"


def _loop() -> list[object]:
    loop: list[object] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    ("run_config", "said"),
    [
        (
            {"fn": print},
            "run_config['fn']: <built-in function print> (builtin_function_or_method) is not",
        ),
        ({"a": {"b": [1, object()]}}, "run_config['a']['b'][1]: <object object at"),
        ({"raw": b"x"}, "run_config['raw']: b'x' (bytes) is not a JSON value"),
        ({"array": np.zeros(3)}, "(ndarray) is not a JSON value"),
        ({(1, 2): 3}, "run_config has the key (1, 2) (tuple); keys are text or numbers"),
        ({1: "a", "1": "b"}, "run_config has the key '1' twice"),
        ({"loop": _loop()}, "run_config['loop'][0] holds itself"),
        ([("a", 1)], "run_config must be a mapping of names to values, got list"),
    ],
)
def test_run_config_refuses_what_json_cannot_hold_naming_the_key(
    run_config: object, said: str
) -> None:
    with pytest.raises(ValueError, match="run_config") as refused:
        config.ReportConfig(run_config=run_config)  # type: ignore[arg-type]
    assert said in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("trackers", "names"),
    [
        ("mlflow, wandb", ("mlflow", "wandb")),
        ("MLflow,wandb,mlflow", ("mlflow", "wandb")),
        (["tensorboard", "wandb, mlflow"], ("tensorboard", "wandb", "mlflow")),
        ((), ()),
    ],
)
def test_tracker_names_are_read_as_the_example_reads_them(
    trackers: object, names: tuple[str, ...]
) -> None:
    assert config.ReportConfig(trackers=trackers).trackers == names  # type: ignore[arg-type]
    if isinstance(trackers, str):
        assert config.parse_trackers(trackers) == names
