"""The flight recorder's variables: on by default, the user's own settings left alone."""

from __future__ import annotations

from pathlib import Path

from ddpkit.distributed.recorder import (
    BUFFER_SIZE,
    dump_prefix,
    enable_recorder,
    local_history,
    point_dumps,
    recorder_state,
)


def test_gloo_gets_the_buffer_and_nothing_of_nccl() -> None:
    env: dict[str, str] = {}
    before = enable_recorder("gloo", env)
    assert env == {"TORCH_FR_BUFFER_SIZE": str(BUFFER_SIZE)}
    assert before == (("TORCH_FR_BUFFER_SIZE", None),)


def test_nccl_also_dumps_on_timeout_and_ends_a_timed_out_rank() -> None:
    env: dict[str, str] = {}
    enable_recorder("nccl", env)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_what_the_user_set_is_left_alone_even_the_old_name() -> None:
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    before = enable_recorder("nccl", env)
    assert "TORCH_FR_BUFFER_SIZE" not in env
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert [name for name, _ in before] == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    state = recorder_state(env)
    assert state["buffer"].startswith("off")
    assert state["nccl dump on timeout"].startswith("off")


def test_dumps_go_to_the_named_directory_unless_the_user_named_one(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert point_dumps(tmp_path, env) == (("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", None),)
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == dump_prefix(tmp_path)
    assert (tmp_path / "flight-recorder").is_dir()
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}
    assert point_dumps(tmp_path, mine) == ()
    assert mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/fr_"


def test_defaults_are_described_as_defaults() -> None:
    state = recorder_state({})
    assert f"{BUFFER_SIZE} collectives" in state["buffer"]
    assert "default" in state["buffer"]
    assert state["nccl error handling"] == "a timed-out collective ends its rank"


def test_a_process_without_collectives_has_no_history() -> None:
    assert local_history("gloo") is None
