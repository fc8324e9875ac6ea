"""The U-Net, data, checkpoints and training loop: shapes, learning, exact resume, determinism, safety."""

import copy
import math

import pytest
import torch
from helpers import TINY_UNET, make_trainer

from basic_diffusion import UNet, UNetConfig, count_parameters, sample, unet_preset
from ddpm.benchmarks.training_bench import warm_timestep_sampler
from ddpm.data.datasets import load_images
from ddpm.formats.checkpoints import load_checkpoint, save_checkpoint
from ddpm.util.messages import TrainingDiverged
from noise_schedule import NoiseSchedule, ScheduleConfig

TINY = {**TINY_UNET, "dropout": 0.1}


@pytest.mark.parametrize("size", [16, 28, 32, 64])
@pytest.mark.parametrize("channels", [1, 3])
def test_unet_output_shape_matches_input(size, channels):
    model = UNet(unet_preset("small", image_size=size, in_channels=channels, model_channels=16)).eval()
    x = torch.randn(2, channels, size, size)
    assert model(x, torch.tensor([0, 999])).shape == x.shape


def test_ddpm_cifar10_preset_has_the_papers_size():
    model = UNet(unet_preset("ddpm_cifar10", image_size=32, in_channels=3))
    assert 35.6e6 < count_parameters(model) < 35.8e6  # Ho et al. report 35.7M


def test_attention_is_placed_at_the_requested_resolution():
    model = UNet(UNetConfig(image_size=16, in_channels=1, **TINY))
    attn_levels = [
        res
        for level, res in zip(model.down, model.config.resolutions)
        for a in level.attentions
        if not isinstance(a, torch.nn.Identity)
    ]
    assert attn_levels == [8]


def test_attention_reads_a_channels_last_input_as_views_with_the_same_result():
    """Channels-last activations (the CPU trainer's) give the heads as views of qkv's memory: the same outputs and
    gradients as NCHW's, and a channels-last output."""
    from basic_diffusion import AttentionBlock

    torch.manual_seed(0)
    block = AttentionBlock(32, num_heads=4, groups=8)
    torch.nn.init.normal_(block.proj.weight, std=0.2)  # past the zero initialization
    x, grad = torch.randn(3, 32, 5, 6), torch.randn(3, 32, 5, 6)

    def run(memory_format):
        leaf = x.clone(memory_format=memory_format).requires_grad_()
        block.zero_grad()
        out = block(leaf)
        out.backward(grad)
        return out, [leaf.grad] + [p.grad.clone() for p in block.parameters()]

    (nchw, nchw_grads), (nhwc, nhwc_grads) = run(torch.contiguous_format), run(torch.channels_last)
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(nhwc, nchw, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(nhwc_grads, nchw_grads):  # float32 rounding: the weights' GEMMs sum in other orders
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale_shift, reaches_output", [(False, False), (True, True)])
def test_the_time_embedding_reaches_the_output_through_groups_of_one_channel(scale_shift, reaches_output):
    # GroupNorm over groups of one channel removes any per-channel constant: the older "add" conditioning
    # (a bias before the norm) is cancelled there; scale-shift conditioning (after the norm) is not.
    from basic_diffusion import ResBlock

    torch.manual_seed(0)
    block = ResBlock(4, 4, emb_dim=8, dropout=0.0, groups=4, scale_shift=scale_shift).eval()
    torch.nn.init.normal_(block.conv2.weight)  # past the identity initialization
    x = torch.randn(2, 4, 8, 8)
    e1, e2 = torch.randn(1, 8).expand(2, 8), torch.randn(1, 8).expand(2, 8)
    with torch.no_grad():
        differs = not torch.allclose(block(x, e1), block(x, e2), atol=1e-5)
    assert differs == reaches_output


def test_a_config_written_before_scale_shift_conditioning_loads_as_the_model_it_was():
    # Checkpoints lack the keys added later (num_classes, time_conditioning): they get the values that
    # rebuild the network they were trained as, and its weights load strictly.
    old = UNetConfig(image_size=16, in_channels=1, time_conditioning="add", **TINY)
    saved = {k: v for k, v in old.to_dict().items() if k not in ("num_classes", "time_conditioning", "patch_size")}
    config = UNetConfig.from_dict(saved)
    assert config == old and config.time_conditioning == "add" and config.num_classes == 0 and config.patch_size == 1
    model = UNet(config)
    model.load_state_dict(UNet(old).state_dict())  # strict: the same parameter shapes
    assert UNetConfig(image_size=16, in_channels=1, **TINY).time_conditioning == "scale_shift"  # new models
    with pytest.raises(ValueError, match="time_conditioning must be one of"):
        UNetConfig.from_dict({**saved, "time_conditioning": "film"})


@pytest.mark.parametrize("size", [30, 10, 0])
def test_unet_rejects_sizes_it_cannot_downsample(size):
    with pytest.raises(ValueError, match="cannot be downsampled"):
        unet_preset("small", image_size=size, in_channels=1)


def test_digits_load_offline_at_any_size():
    images = load_images("digits", data_dir="unused", image_size=16)
    assert images.images.shape == (1797, 1, 16, 16) and images.images.dtype == torch.uint8
    batch = images.batch(0, batch_size=8, seed=0)
    assert batch.shape == (8, 1, 16, 16) and batch.min() >= -1 and batch.max() <= 1
    assert batch.min() == -1 and batch.max() > 0.9  # the full pixel range is used


def test_batches_are_a_function_of_seed_and_step():
    images = load_images("digits", data_dir="unused", image_size=8)
    a = images.batch(57, batch_size=32, seed=3)
    assert torch.equal(a, images.batch(57, batch_size=32, seed=3))
    assert not torch.equal(a, images.batch(58, batch_size=32, seed=3))
    # One epoch visits every image once.
    epoch = torch.cat([images.batch(k, batch_size=599, seed=0) for k in range(3)])
    assert (
        epoch.shape[0] == 1797
        and torch.unique(epoch, dim=0).shape[0] == torch.unique(images.images.float(), dim=0).shape[0]
    )


def test_folder_dataset_reads_images_and_rejects_bad_ones(tmp_path):
    from PIL import Image

    with pytest.raises(ValueError, match="holds no images"):
        load_images("folder", data_dir=tmp_path, image_size=16, channels=3)
    with pytest.raises(ValueError, match="does not exist"):
        load_images("folder", data_dir=tmp_path / "nope", image_size=16, channels=3)
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "red.png")
    images = load_images("folder", data_dir=tmp_path, image_size=16, channels=3)
    assert images.images.shape == (1, 3, 16, 16)
    assert images.images[0, 0].min() == 255 and images.images[0, 1].max() == 0
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="cannot read image"):
        load_images("folder", data_dir=tmp_path, image_size=16, channels=3)


@pytest.mark.parametrize("dataset,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_torchvision_files_placed_in_data_dir_are_used_offline(tmp_path, dataset, folder):
    # The files an offline user places by hand (torchvision's idx format) are read without a download.
    import struct

    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    pixels = torch.arange(5 * 28 * 28, dtype=torch.int64).remainder(256).to(torch.uint8)
    for split, n in (("train", 5), ("t10k", 2)):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + pixels[: n * 784].numpy().tobytes()
        )
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + bytes(n))
    images = load_images(dataset, data_dir=tmp_path, image_size=28)
    assert images.images.shape == (5, 1, 28, 28)
    assert torch.equal(images.images.flatten(), pixels)


def test_missing_torchvision_files_explain_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="offline: --dataset mnist_5k .*, --data_dir holding .*, or --dataset folder"):
        load_images("mnist", data_dir=tmp_path, image_size=28, download=False)


def test_loss_falls_on_digits(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, total_steps=80)  # measured: the last 20 average 0.1 to 0.2 of the first 20
    losses = trainer.run(progress=False)
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.5 * first, (first, last)


def test_checkpoint_round_trip(tmp_path):
    trainer = make_trainer(tmp_path, total_steps=3)
    trainer.run(progress=False)
    state = load_checkpoint(tmp_path / "run.pt")
    assert state["step"] == 3
    for key in ("model", "ema"):
        ref = getattr(trainer, key).state_dict()
        assert ref.keys() == state[key].keys()
        assert all(torch.equal(ref[k], state[key][k]) for k in ref)
    assert not torch.equal(state["model"]["conv_out.weight"], state["ema"]["conv_out.weight"])
    assert (tmp_path / "run_samples" / "step_0000003.png").is_file()
    assert not list(tmp_path.rglob(".*.tmp-*")), "a temporary file was left behind"  # safe_files.temp_prefix's names


def test_resume_continues_the_same_loss_curve(tmp_path):
    straight = make_trainer(tmp_path / "a", total_steps=6).run(progress=False)
    first = make_trainer(tmp_path / "b", total_steps=6)
    head = first.run(until_step=3, progress=False)
    first.save()
    resumed = make_trainer(tmp_path / "b", total_steps=6, state=load_checkpoint(tmp_path / "b" / "run.pt"))
    tail = resumed.run(progress=False)
    assert head + tail == straight  # bit-for-bit on the CPU
    end_a, end_b = load_checkpoint(tmp_path / "a" / "run.pt"), load_checkpoint(tmp_path / "b" / "run.pt")
    assert all(torch.equal(end_a["ema"][k], end_b["ema"][k]) for k in end_a["ema"])


@pytest.mark.parametrize("name", ["importance", "topk", "speed"])
def test_resume_with_an_adaptive_timestep_sampler_continues_the_same_loss_curve(tmp_path, name):
    """The sampler's learned state lives in the checkpoint: past its warm-up, a resumed run draws the same t."""

    def warmed(path, **kw):
        trainer = make_trainer(path, timestep_sampling=name, **kw)
        if "state" not in kw:
            warm_timestep_sampler(trainer.timesteps)  # past the warm-up: draws follow the learned distribution
        return trainer

    straight_trainer = warmed(tmp_path / "a")
    assert straight_trainer.timesteps.ready()
    if name != "speed":  # speed saw a loss that never changed: converged everywhere, so p stays uniform
        assert straight_trainer.timesteps.probabilities().max() > 0.02  # not uniform (0.01)
    straight = straight_trainer.run(progress=False)
    first = warmed(tmp_path / "b")
    head = first.run(until_step=3, progress=False)
    first.save()
    tail = warmed(tmp_path / "b", state=load_checkpoint(tmp_path / "b" / "run.pt")).run(progress=False)
    assert head + tail == straight  # bit-for-bit on the CPU


def test_importance_sampled_training_weights_the_loss_by_one_over_T_p(tmp_path):
    """A training step's loss under importance sampling is mean_b(w_b L_b), w = 1/(T p_t) (Nichol & Dhariwal)."""
    trainer = make_trainer(tmp_path, timestep_sampling="importance")
    warm_timestep_sampler(trainer.timesteps)
    sampler = trainer.timesteps
    p, w = sampler.probabilities(), sampler.timestep_weights()
    assert torch.allclose(w, 1.0 / (100 * p))
    generator = torch.Generator().manual_seed(0)
    t, weights = sampler.sample(4096, generator=generator, device="cpu")
    assert torch.equal(weights, w[t].float())
    # Drawn where p is large: the timesteps with the largest (synthetic) loss are drawn most.
    assert (t < 10).float().mean() > 10 / 100


def test_non_finite_loss_never_reaches_a_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, total_steps=30)
    trainer.images.batch_with_labels = lambda step, **kw: (torch.full((16, 1, 16, 16), math.nan), None)  # poisoned data
    before = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(TrainingDiverged, match="non-finite"):
        trainer.run(progress=False)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items()), "a NaN update was applied"
    assert not (tmp_path / "run.pt").exists()
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(math.inf)
    with pytest.raises(TrainingDiverged, match="not written"):
        trainer.save()
    assert not (tmp_path / "run.pt").exists()


def test_same_seed_same_images_other_seed_other_images():
    model = UNet(UNetConfig(image_size=16, in_channels=1, **TINY)).eval()
    plan = NoiseSchedule(ScheduleConfig(num_timesteps=50)).make_plan("ddpm", sampling_steps=10)

    def draw(seed):
        return sample(model, plan, shape=(2, 1, 16, 16), generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_checkpoint_loader_refuses_foreign_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a checkpoint written by this tool"):
        load_checkpoint(tmp_path / "other.pt")
    # A pickle that would run code on load is refused by weights_only.
    torch.save({"payload": Exploit(tmp_path / "pwned")}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refused"):
        load_checkpoint(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


class Exploit:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class FailsToPickle:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ck.pt"
    configs = {
        "model_config": UNetConfig().to_dict(),
        "schedule_config": ScheduleConfig().__dict__,
    }  # load validates them
    good = {"format_version": 1, **configs, "model": {}, "ema": {}, "step": 1}
    save_checkpoint(path, good)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(path, {**good, "step": FailsToPickle()})
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_atomic_writes_get_the_usual_file_mode(tmp_path):
    import os

    from ddpm.util.safe_files import atomic_write

    mask = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "f.bin", lambda f: f.write(b"x"))
    finally:
        os.umask(mask)
    assert (path.stat().st_mode & 0o777) == 0o644


def test_resume_on_another_device_is_refused_clearly(tmp_path):
    trainer = make_trainer(tmp_path, total_steps=2)
    trainer.run(progress=False)
    state = load_checkpoint(tmp_path / "run.pt")
    state["rng"]["device"] = "cuda"
    with pytest.raises(ValueError, match="--device cuda"):
        make_trainer(tmp_path, total_steps=2, state=state)


def test_unet_rejects_widths_the_heads_do_not_divide():
    with pytest.raises(ValueError, match="num_heads"):
        unet_preset("small", image_size=16, in_channels=1, model_channels=25)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_min_snr_weights_are_min_snr_gamma_in_x0_space_in_float64(prediction):
    schedule = NoiseSchedule(ScheduleConfig(prediction=prediction))
    t = torch.arange(1000)
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    snr = alpha_bar / (1 - alpha_bar)
    x0_weight = torch.minimum(snr, torch.tensor(5.0, dtype=torch.float64))
    # An output error e is an x_0 error of e * sqrt(1 / snr) (eps), e * sqrt(1 - abar) (v), e (x_0).
    expected = x0_weight / {"eps": snr, "v": snr + 1, "x0": torch.ones_like(snr)}[prediction]
    assert torch.allclose(schedule.loss_weights(t, min_snr_gamma=5.0).double(), expected, rtol=1e-5)
    if prediction == "eps":
        assert expected[-1] == 1 and expected[0] < 1e-3  # noisy steps keep weight 1, nearly clean ones are damped


def test_min_snr_loss_with_a_gamma_above_every_snr_is_the_unweighted_loss():
    from basic_diffusion import diffusion_loss

    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=50))
    model = UNet(UNetConfig(image_size=8, in_channels=1, **{**TINY, "attention_resolutions": ()})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.rand(6, 1, 8, 8) * 2 - 1
    gamma = float(schedule.snr.max()) * 2
    plain = diffusion_loss(model, schedule, x, generator=torch.Generator().manual_seed(1))
    weighted = diffusion_loss(model, schedule, x, generator=torch.Generator().manual_seed(1), min_snr_gamma=gamma)
    assert torch.allclose(plain, weighted, rtol=1e-6)
    damped = diffusion_loss(model, schedule, x, generator=torch.Generator().manual_seed(1), min_snr_gamma=1e-3)
    assert damped < plain  # every weight is below 1
