"""More than one process (torchrun, gloo on the CPU): two ranks train the weights one process trains
with the same global batch, their checkpoint resumes in one process, sampling on two ranks writes
the one-process .npz, and a global batch that does not split is refused on every rank."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_user_error, run_here

from ddpm.util import distributed
from ddpm.util.distributed import Ranks

# No dropout: each rank draws its own dropout masks, so only without it are the weights one process's.
TRAIN = [
    "--mode",
    "train",
    "--dataset",
    "digits",
    "--img_size",
    "16",
    "--model_channels",
    "16",
    "--num_res_blocks",
    "1",
    "--dropout",
    "0",
    "--timesteps",
    "10",  # the end-of-run preview samples every timestep up to 100: few, so it is cheap
    "--max_steps",
    "4",
    "--batch_size",
    "8",
    "--sample_every",
    "0",
]
SAMPLE = ["--mode", "sample", "--n_samples", "5", "--batch_size", "2", "--sampler", "ddim", "--sampling_steps", "4"]


def launch(*args: str, cwd: Path, ranks: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """main.py under torchrun with ``ranks`` processes on this machine (killed after ``timeout`` seconds), or
    (``ranks`` 1, the reference) main.main in this process, on one thread as each rank runs (no torch import of a
    new process)."""
    if ranks == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_here(*args, cwd=cwd)
        finally:
            torch.set_num_threads(threads)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores
    return subprocess.run(
        [*launcher, str(ROOT / "main.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(sampling)``: the folder holding the same run (with that timestep sampling) in one process and on
    two ranks, ``{sampling}1.pt`` and ``{sampling}2.pt``; each pair is trained once, when first asked for."""
    work, done = tmp_path_factory.mktemp("ranks"), set()

    def pair(sampling: str) -> Path:
        for ranks in () if sampling in done else (1, 2):
            result = launch(
                *TRAIN, "--timestep_sampling", sampling, "--model_path", f"{sampling}{ranks}.pt", cwd=work, ranks=ranks
            )
            assert result.returncode == 0, result.stderr[-3000:]
            (work / f"{sampling}{ranks}.out").write_text(result.stdout)
        done.add(sampling)
        return work

    return pair


@pytest.fixture(scope="module")
def runs(trained) -> Path:
    return trained("uniform")


@pytest.mark.parametrize(
    "sampling",
    ["uniform", pytest.param("importance", marks=pytest.mark.slow)],  # two more launches, one under torchrun
)
def test_two_ranks_train_the_weights_of_one_process_with_the_same_global_batch(trained, sampling):
    runs = trained(sampling)
    one, two = weights(runs / f"{sampling}1.pt"), weights(runs / f"{sampling}2.pt")
    assert one["step"] == two["step"] == 4
    assert max_difference(one["model"], two["model"]) < 1e-5
    assert max_difference(one["ema"], two["ema"]) < 1e-5
    # Rank 0 gathered every rank's losses, so the timestep history is the whole batch's.
    assert one["timestep_sampler"].keys() == two["timestep_sampler"].keys()
    for key, value in one["timestep_sampler"].items():
        if isinstance(value, torch.Tensor):
            assert torch.allclose(value.double(), two["timestep_sampler"][key].double(), rtol=1e-5, atol=1e-6), key
    assert (one["train_config"]["world_size"], two["train_config"]["world_size"]) == (1, 2)
    first = (runs / f"{sampling}2.out").read_text().splitlines()[0]
    assert "on 2 ranks (gloo), 4 images each" in first  # the run says how many ranks train, once
    assert (runs / f"{sampling}2.out").read_text().count("checkpoint:") == 1  # rank 0 alone reports


def test_a_two_rank_checkpoint_resumes_in_one_process_on_the_same_curve(runs, tmp_path):
    for name in ("uniform1.pt", "uniform2.pt"):
        shutil.copy(runs / name, tmp_path / name)
        result = run_here("--mode", "train", "--resume", "--max_steps", "6", "--model_path", name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = weights(tmp_path / "uniform1.pt"), weights(tmp_path / "uniform2.pt")
    assert one["step"] == two["step"] == 6
    assert max_difference(one["model"], two["model"]) < 1e-5
    assert two["train_config"]["world_size"] == 1


def test_sampling_on_two_ranks_writes_the_one_process_npz_and_grid(runs):
    for ranks in (1, 2):
        result = launch(
            *SAMPLE,
            "--model_path",
            "uniform1.pt",
            "--save_npz",
            f"s{ranks}.npz",
            "--output",
            f"s{ranks}.png",
            cwd=runs,
            ranks=ranks,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = np.load(runs / "s1.npz")["images"], np.load(runs / "s2.npz")["images"]
    assert one.shape == (5, 16, 16, 1)
    np.testing.assert_array_equal(one, two)  # 3 batches: rank 0 drew batches 0 and 2, rank 1 batch 1
    assert (runs / "s1.png").read_bytes() == (runs / "s2.png").read_bytes()


def test_a_global_batch_that_does_not_split_is_refused_on_every_rank(tmp_path):
    result = launch(*TRAIN, "--batch_size", "7", "--model_path", "bad.pt", cwd=tmp_path, ranks=2)
    assert result.returncode != 0
    refusal = "--batch_size 7 is the global batch and must divide by the 2 ranks training together"
    ours = [line for line in result.stderr.splitlines() if line.startswith("main.py: error:")]  # whole lines
    assert sorted(ours) == [
        f"main.py: error: rank {r}/2: {refusal} (each rank takes an equal share); try --batch_size 6, or a number of "
        "ranks that divides it"
        for r in (0, 1)
    ]
    assert not (tmp_path / "bad.pt").exists()


@pytest.mark.slow  # minutes on 2 cores: every training variant, alone and on two ranks, compile rows included
def test_the_training_benchmark_reports_per_rank_throughput_and_scaling_under_torchrun(tmp_path):
    args = [
        "--mode",
        "benchmark",
        "--bench",
        "training",
        *TRAIN[2:12],
        "--batch_size",
        "8",
        "--train_steps",
        "2",
        "--warmup",
        "1",
        "--json",
        "t.json",
    ]
    started = time.perf_counter()
    # Its compile rows compile twice (two ranks, then one), longer with a cold Inductor cache.
    result = launch(*args, cwd=tmp_path, ranks=2, timeout=900)
    wall = time.perf_counter() - started  # an outer bound on every timed step
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["environment"]["ranks"] == 2
    for row in report["training_rows"]:
        assert row["status"] == "ok", row
        assert 2 * 8 / wall < row["images_per_s"] and 2 * 4 / wall < row["single_rank_images_per_s"]  # 2 timed steps
        assert row["images_per_s_per_rank"] == pytest.approx(row["images_per_s"] / 2)
        assert row["scaling_efficiency"] == pytest.approx(
            row["images_per_s_per_rank"] / row["single_rank_images_per_s"]
        )
    assert result.stdout.count("img/s/rank") == 1  # one table, from rank 0


# ----- in one process ----------------------------------------------------------------------------
def test_ranks_share_a_batch_in_rank_order_and_deal_batches_round_robin():
    shares = [Ranks(rank=r, world_size=4).share(8) for r in range(4)]
    assert [list(range(8))[s] for s in shares] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [i for i in range(7) if Ranks(rank=1, world_size=3).owns(i)] == [1, 4]
    assert distributed.SINGLE.share(5) == slice(0, 5) and distributed.SINGLE.label() == ""
    assert Ranks(rank=1, world_size=2).label() == "rank 1/2: "


def test_the_torchrun_environment_is_read_and_checked():
    assert distributed.from_environment({}) == distributed.SINGLE
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert distributed.from_environment(env) == Ranks(rank=3, world_size=4, local_rank=1)
    with pytest.raises(ValueError, match="not integers"):
        distributed.from_environment({**env, "RANK": "x"})
    with pytest.raises(ValueError, match="not a valid place"):
        distributed.from_environment({**env, "RANK": "4"})


def test_modes_that_run_in_one_process_are_refused_under_torchrun(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    result = run_here("--mode", "evaluate", "--model_path", "m.pt", cwd=tmp_path)
    assert_user_error(result, "--mode evaluate runs in one process")


def test_each_sampling_batch_draws_from_its_own_seed():
    """Batch i's images depend on (seed, i) only: the property that lets ranks share batches out."""
    from ddpm.backends.registry import batch_generator

    device = torch.device("cpu")
    first = torch.randn(3, generator=batch_generator(7, 0, device=device))
    assert torch.equal(first, torch.randn(3, generator=torch.Generator().manual_seed(7)))  # batch 0: --seed itself
    again = torch.randn(3, generator=batch_generator(7, 2, device=device))
    assert torch.equal(again, torch.randn(3, generator=batch_generator(7, 2, device=device)))
    assert not torch.equal(again, torch.randn(3, generator=batch_generator(7, 1, device=device)))


@pytest.mark.slow  # three launches, one under torchrun
@pytest.mark.parametrize("method", ["regression", "adversarial", "dmd", "consistency"])
def test_two_ranks_distill_the_student_of_one_process(runs, tmp_path, method):
    """Each --distill_method: a method's own network (discriminator, fake score) is stepped with gradients averaged
    over the ranks, so it stays one process's too; the consistency method's target follows the same student; the
    adversarial method's real digits are the same global batch's."""
    distill = ["--mode", "distill", "--model_path", str(runs / "uniform1.pt"), "--distill_samples", "8"]
    distill += ["--teacher_steps", "8", "--batch_size", "8", "--max_steps", "3", "--sampling_steps", "2"]
    distill += ["--distill_method", method]
    for ranks in (1, 2):
        result = launch(*distill, "--output", f"student{ranks}.pt", cwd=tmp_path, ranks=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = weights(tmp_path / "student1.pt"), weights(tmp_path / "student2.pt")
    assert one["step"] == two["step"] == 3
    assert max_difference(one["model"], two["model"]) < 1e-5
    for name, state in one.get("objective_state", {}).items():
        assert max_difference(state["network"], two["objective_state"][name]["network"]) < 1e-5, name
