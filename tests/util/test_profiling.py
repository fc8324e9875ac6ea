"""profiling.py: where the trace lands, what it holds, the schedule, and what is refused."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

from ddpm.util.profiling import (
    NullProfiler,
    ProfileConfig,
    Profiler,
    make_profiler,
    tensorboard_hint,
)
from ddpm.util.safe_files import WriteError

# torch-tb-profiler's consts.WORKER_PATTERN: a folder holding a file matching it is a run, the match a worker
TB_PLUGIN_TRACE = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")

pytestmark = pytest.mark.usefixtures("one_thread", "kineto_started")


@pytest.fixture(scope="module")
def kineto_started() -> None:
    # The first torch.profiler session of a process costs ~2 s (Kineto starting up); pay it once here.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(1).add_(1)


def run_steps(config: ProfileConfig, steps: int, *, logs: list[str] | None = None) -> Profiler:
    """``steps`` tiny steps: a matmul inside a "unet" range, an add outside it."""
    x = torch.randn(8, 8)
    with Profiler(config, device="cpu", log=(logs if logs is not None else []).append) as prof:
        for _ in range(steps):
            with prof.range("unet"):
                y = x @ x  # aten::mm
            x = (y + 1.0) / 10.0
            prof.step()
    return prof


def trace_events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def step_names(path: Path) -> set[str]:
    return {e["name"] for e in trace_events(path) if e.get("name", "").startswith("ProfilerStep#")}


def test_trace_lands_where_tensorboard_reads_it_and_holds_only_active_steps(tmp_path: Path) -> None:
    prof = run_steps(ProfileConfig(str(tmp_path), "train", wait=1, warmup=1, active=3), 6)

    traces = list(tmp_path.glob("train/plugins/profile/*/*.pt.trace.json*"))
    assert traces == [prof.trace_path]
    assert TB_PLUGIN_TRACE.match(traces[0].name).group(2) is None  # one worker, no span suffix
    assert any(e.get("name") == "unet" for e in trace_events(traces[0]))
    assert step_names(traces[0]) == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}  # steps 0, 1: wait, warmup
    assert sorted(p.name for p in traces[0].parent.iterdir()) == sorted(p.name for p in prof.written)


def test_summary_names_the_ops_the_workload_ran(tmp_path: Path) -> None:
    logs: list[str] = []
    prof = run_steps(ProfileConfig(str(tmp_path), "sample-cpu"), 5, logs=logs)

    assert prof.summary_path == prof.trace_path.parent / "summary.txt"
    summary = prof.summary_path.read_text()
    assert "aten::mm" in summary and "unet" in summary
    assert logs[0].strip() == summary.strip()
    assert logs[-1].startswith("profile: wrote ") and str(prof.trace_path) in logs[-1]


def test_two_runs_into_one_directory_keep_both_traces(tmp_path: Path) -> None:
    config = ProfileConfig(str(tmp_path), "train", wait=0, warmup=1, active=1)
    first, second = run_steps(config, 2), run_steps(config, 2)

    assert first.folder != second.folder
    assert sorted(tmp_path.glob("train/plugins/profile/*/*.pt.trace.json")) == sorted(
        [first.trace_path, second.trace_path]
    )


@pytest.mark.parametrize(
    ("total_steps", "expected"),
    [(None, (1, 1, 3)), (9, (1, 1, 3)), (5, (1, 1, 3)), (4, (0, 1, 3)), (3, (0, 1, 2)), (2, (0, 1, 1)), (1, (0, 0, 1))],
)
def test_schedule_is_fitted_to_total_steps_wait_first_then_active_then_warmup(total_steps, expected) -> None:
    config = ProfileConfig("unused", "train", wait=1, warmup=1, active=3, total_steps=total_steps)
    assert config.fitted() == expected


def test_a_run_shorter_than_the_schedule_is_traced_when_total_steps_is_given(tmp_path: Path) -> None:
    prof = run_steps(ProfileConfig(str(tmp_path), "train", total_steps=2), 2)  # fitted to wait 0, warmup 1, active 1
    assert step_names(prof.trace_path) == {"ProfilerStep#1"}


def test_a_run_ending_inside_the_active_window_still_writes_what_it_recorded(tmp_path: Path) -> None:
    prof = run_steps(ProfileConfig(str(tmp_path), "train", wait=1, warmup=1, active=3), 3)
    assert "ProfilerStep#2" in step_names(prof.trace_path)
    assert "ProfilerStep#4" not in step_names(prof.trace_path)


@pytest.mark.parametrize("steps", [1, 2])  # after 2, step 2 has begun (an empty ProfilerStep#2) but not ended
def test_a_run_ending_before_an_active_step_ends_writes_no_trace_and_says_so(tmp_path: Path, steps: int) -> None:
    logs: list[str] = []
    prof = run_steps(ProfileConfig(str(tmp_path), "train", wait=1, warmup=1, active=3), steps, logs=logs)

    assert prof.trace_path is None and prof.written == ()
    assert list(tmp_path.rglob("*.pt.trace.json*")) == []
    assert len(logs) == 1 and logs[0].startswith("profile: no trace written") and "\n" not in logs[0]


def test_ctrl_c_inside_the_active_window_stops_the_profiler_without_writing(tmp_path: Path) -> None:
    logs: list[str] = []
    config = ProfileConfig(str(tmp_path), "train", wait=0, warmup=1, active=3)
    with pytest.raises(KeyboardInterrupt), Profiler(config, device="cpu", log=logs.append) as prof:
        for _ in range(2):  # step 0: warmup, step 1: recorded, step 2 under way: a trace is due
            torch.ones(4) @ torch.ones(4)
            prof.step()
        raise KeyboardInterrupt
    assert prof.written == () and logs == []
    assert list(tmp_path.rglob("*.pt.trace.json*")) == []


FULL = os.statvfs_result((4096, 4096, 256, 0, 0, 64, 0, 0, 0, 255))  # a file system with no block free
FULL_DISK_LINE = re.compile(
    r"cannot write prof/train/plugins/profile/[0-9_]+/[A-Za-z0-9_-]+\.pt\.trace\.json: No space left on device; "
    r"no file was created and nothing partial was left"
)


def kineto_on_a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.profiler's writer on a full disk: it stops short in its own ``<path>.tmp`` and raises nothing."""

    def export(self, path: str) -> None:
        Path(f"{path}.tmp").write_text('{"traceEvents": [')
        monkeypatch.setattr(os, "statvfs", lambda folder: FULL)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)


@pytest.mark.parametrize("existing", [False, True])
def test_a_trace_on_a_full_disk_ends_in_one_line_and_leaves_only_what_was_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """Found by the adversarial pass: the trace's rename named ENOENT, not the full disk, and left a half-written
    ``.partial.tmp``; now the one line of every refused write, and the folders the run made are gone (a --profile
    folder that was there stays, with what it held)."""
    monkeypatch.chdir(tmp_path)
    if existing:
        Path("prof").mkdir()
        Path("prof/notes.txt").write_text("mine")
    kineto_on_a_full_disk(monkeypatch)
    with pytest.raises(WriteError) as info:
        run_steps(ProfileConfig("prof", "train", wait=0, warmup=0, active=1), 2)
    assert FULL_DISK_LINE.fullmatch(str(info.value)), str(info.value)
    assert sorted(str(p) for p in Path().rglob("*")) == (["prof", "prof/notes.txt"] if existing else [])


def test_a_summary_on_a_full_disk_leaves_no_profile_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """summary.txt is written like every output (safe_files.atomic_write): a refused write is one line naming it, and
    the trace written before it goes with the folder."""
    monkeypatch.chdir(tmp_path)

    def full(fd: int) -> None:  # the buffered summary reaching a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteError, match=r"cannot write prof/.*/summary\.txt: No space left on device; no file"):
        run_steps(ProfileConfig("prof", "train", wait=0, warmup=0, active=1), 2)
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_own_write_is_refused_leaves_no_profile(tmp_path: Path) -> None:
    """A run ending in a refused write (its checkpoint on a full disk) says nothing partial was left: its profile,
    written or not, goes too; any other error still writes the trace leading up to it."""
    config = ProfileConfig(str(tmp_path / "prof"), "train", wait=0, warmup=0, active=1)
    with pytest.raises(OSError, match="No space left"), Profiler(config, device="cpu", log=[].append) as prof:
        prof.step()
        prof.step()  # the trace is written here
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert prof.written == () and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError), Profiler(config, device="cpu", log=[].append) as prof:
        prof.step()
        prof.step()
        raise ValueError("a bug")
    assert prof.trace_path is not None and prof.trace_path.is_file()


def test_a_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "profile-out"
    target.write_text("not a folder")
    with pytest.raises(ValueError, match="profile-out exists and is not a directory"):
        Profiler(ProfileConfig(str(target), "train"), device="cpu")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "train").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        make_profiler(ProfileConfig(str(tmp_path / "ok"), "train"), device="cpu")
    assert target.read_text() == "not a folder"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"wait": -1}, "wait must be >= 0, got -1"),
        ({"warmup": -2}, "warmup must be >= 0, got -2"),
        ({"active": 0}, "active must be >= 1, got 0"),
        ({"total_steps": 0}, "total_steps must be >= 1, got 0"),
        ({"run_name": "../x"}, "one folder name"),
        ({"run_name": ""}, "one folder name"),
    ],
)
def test_bad_schedules_and_run_names_are_refused_in_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        ProfileConfig(**{"directory": "d", "run_name": "train", **fields})
    assert "\n" not in str(error.value)


def test_the_null_profiler_does_nothing(tmp_path: Path) -> None:
    prof = make_profiler(None, device="cpu")
    assert isinstance(prof, NullProfiler)
    with prof as p:
        with p.range("unet"):
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        p.step()
    assert torch.equal(y, torch.full((2, 2), 2.0))
    assert p.written == () and p.trace_path is None and p.summary_path is None


def test_tensorboard_hint_names_the_directory_and_the_packages() -> None:
    assert tensorboard_hint("runs/prof") == "tensorboard --logdir runs/prof (pip install tensorboard torch-tb-profiler)"
