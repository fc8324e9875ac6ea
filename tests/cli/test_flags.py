"""cli/flags.py and cli/parser.py: each mode reads its own flags (the table READ_BY), refuses the others in
one line naming the modes that read them, shows only its own in ``--mode MODE --help``, and parses without
importing torch."""

import subprocess
import sys

import pytest
from helpers import ROOT

from ddpm.choices import SAMPLERS
from ddpm.cli import parser
from ddpm.cli.flags import FLAGS, READ_BY, flags_of
from ddpm.cli.parser import not_read_by_run
from ddpm.cli.reads import MODES
from ddpm.requests import EvaluateRequest, ModelSource, SamplingChoice

REQUIRED = {"distill": ["--model_path", "teacher.pt"]}  # a mode's required flags, given with every other


def written(name: str, mode: str) -> list[str]:
    """``--name`` with a value of the form it takes in ``mode``'s parser (a switch: no value)."""
    options = FLAGS[name].options_for(mode)
    if options.get("action") == "store_true":
        return [f"--{name}"]
    if options.get("choices") is not None:
        return [f"--{name}", str(list(options["choices"])[-1])]
    return [f"--{name}", {"sampler": SAMPLERS[-1], "eta": "0.5"}.get(name, "x" if "type" not in options else "3")]


def test_every_mode_reads_the_common_flags_and_distill_reads_the_leads_list():
    import importlib

    import main

    assert set(MODES) == {"train", "sample", "evaluate", "benchmark", "export", "train_autoencoder", "distill"}
    for mode in MODES:  # main.py runs each mode's run_<mode>, named in its code (train_autoencoder's in modes/train)
        module = importlib.import_module(f"ddpm.modes.{mode.removesuffix('_autoencoder')}")
        assert main.run_mode(mode) is getattr(module, f"run_{mode}")
    assert all(set(READ_BY[name]) == set(MODES) for name in ("mode", "device", "seed", "precision", "model_path"))
    assert set(flags_of("distill")) == {
        *("mode", "device", "seed", "precision", "profile", "model_path", "autoencoder", "output"),
        *("sampling_steps", "guidance_scale", "distill_samples", "teacher_steps", "compile"),
        *("distill_method", "adv_weight", "dmd_weight", "adv_real", "data_dir"),
        *("max_steps", "batch_size", "lr", "warmup_steps", "ema_decay", "grad_clip", "save_every"),
        *("resume", "overwrite", "log_dir", "log_every"),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [name for name in READ_BY if name != "mode"])
def test_a_flag_is_accepted_exactly_by_the_modes_that_read_it(capsys, name, mode):
    argv = ["--mode", mode, *REQUIRED.get(mode, []), *written(name, mode)]
    if mode in READ_BY[name]:
        args = parser.parse_args(argv)
        assert name in args.given and args.mode == mode
        return
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    readers = READ_BY[name]
    assert f"--{name}" in err and f"by --mode {readers[0]}" in err and err.endswith(f", not {mode} (see --help)")
    assert all(reader in err for reader in readers)


def test_the_refusal_names_the_modes_and_what_a_model_flag_is(capsys):
    for argv, line in (
        (["--mode", "sample", "--json", "x.json"], "--json is read by --mode evaluate and benchmark, not sample"),
        (["--mode", "sample", "--json=x.json"], "--json is read by --mode evaluate and benchmark, not sample"),
        # no abbreviations: benchmark's --warmup is not train's --warmup_steps
        (["--mode", "train", "--warmup", "3"], "--warmup is read by --mode benchmark, not train"),
        (
            ["--mode", "export", "--timesteps", "10"],
            "--timesteps describes a new model: read by --mode train and benchmark, not export",
        ),
        (["--mode", "sample", "--nonsense", "1"], "unrecognized arguments: --nonsense 1"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert capsys.readouterr().err == f"main.py: error: {line} (see --help)\n"


def test_given_holds_the_written_flags_and_every_flag_has_its_default():
    args = parser.parse_args(["--mode", "sample", "--n_samples", "4", "--no_ema"])
    assert args.given == {"mode", "n_samples", "no_ema"}
    assert (args.n_samples, args.no_ema, args.lr, args.resume, args.timesteps) == (4, True, None, False, 1000)
    assert parser.parse_args([]).mode == "train"
    distill = parser.parse_args(["--mode", "distill", "--model_path", "t.pt"])
    assert (distill.sampling_steps, distill.distill_samples, distill.teacher_steps) == (4, 4096, 32)


@pytest.mark.parametrize("mode", MODES)
def test_a_modes_help_lists_exactly_its_flags(mode):
    mode_parser = parser.build_parser(mode)
    listed = {action.dest for action in mode_parser._actions} - {"help"}
    assert listed == set(flags_of(mode))
    help_text = mode_parser.format_help()
    assert all(f"--{name}" in help_text for name in listed)


def test_help_without_a_mode_lists_the_modes_and_the_common_flags():
    help_text = parser.overview_parser().format_help()
    assert all(f"  {mode} " in help_text for mode in MODES)
    assert "--device" in help_text and "--mode MODE --help" in help_text
    assert "--sampler" not in help_text and "--json" not in help_text


@pytest.mark.parametrize(
    "argv,shown,hidden",
    [
        (["--help"], "--device", "--sampler"),
        (["--mode", "sample", "--help"], "--sampler", "--lr"),
        (["--mode", "distill", "-h"], "--teacher_steps", "--sampler"),
    ],
)
def test_help_is_printed_without_importing_torch(argv, shown, hidden):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "main.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0 and "usage: main.py" in result.stdout, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "numpy" not in imported
    assert shown in result.stdout and hidden not in result.stdout


@pytest.mark.parametrize(
    "sampler,eta,refused",
    [("ddim", 0.5, None), ("ddpm", 0.0, None), ("ddpm", 0.5, "only applies to the ddim"), ("ddim", 2.0, "between")],
)
def test_evaluate_takes_sample_modes_sampler_and_eta_rules(sampler, eta, refused):
    source = ModelSource("m.pt")
    for build in (
        lambda: SamplingChoice(sampler=sampler, eta=eta),
        lambda: EvaluateRequest(
            device=None,
            precision="fp32",
            source=source,
            implementation="original",
            samplers=["ddim", sampler],
            sampling_steps=[None],
            dataset=None,
            eta=eta,
        ),
    ):
        if refused is None:
            build()
        else:
            with pytest.raises(ValueError, match=refused):
                build()


@pytest.mark.parametrize(
    "flags,refused",
    [
        (
            ["--implementation", "original", "--trt_opt_level", "2"],
            "--trt_opt_level is read by --mode .* with --implementation tensorrt, not --implementation original",
        ),
        (["--implementation", "onnxruntime", "--max_batch", "8"], "--max_batch is read by --mode .* tensorrt"),
        (["--implementation", "cuda", "--opset", "21"], "--opset is read by .* onnxruntime or tensorrt, not .* cuda"),
        (["--implementation", "onnxruntime", "--opset", "21", "--model_path", "m.onnx"], "m.onnx is one already"),
        (["--implementation", "onnxruntime", "--opset", "21"], None),
        (["--implementation", "tensorrt", "--trt_opt_level", "2", "--opset", "21"], None),
    ],
)
def test_the_runtime_flags_are_read_only_by_the_implementations_that_build_a_graph(flags, refused):
    """sample and evaluate read --opset and the TensorRT flags, but only some implementations do."""
    from ddpm.cli import resolve

    for mode in ("sample", "evaluate"):
        argv = ["--mode", mode, "--device", "cpu", "--n_samples", "4", *flags]
        if refused is None:
            args = parser.parse_args(argv)
            assert not_read_by_run(mode, vars(args), args.given) is None
            resolve._refuse_unread_runtime_flags(args, kind="checkpoint")
        else:
            with pytest.raises(ValueError, match=refused):
                resolve.parse(argv)


def help_of(mode: str, name: str) -> str:
    """The help line of ``--name`` in ``mode``'s --help, as printed (argparse's wrapping undone)."""
    text = parser.build_parser(mode).format_help()
    entry = text[text.index(f"  --{name} ") :].split("\n  --")[0]
    return " ".join(entry.split())


def test_distills_help_shows_the_recipe_a_distillation_runs_with():
    """Every default of distill's recipe is written once (ddpm/choices.py) and --help prints the value the
    request gets when the flag is left out."""
    from ddpm.cli import resolve

    _, request = resolve.parse(["--mode", "distill", "--model_path", "teacher.pt", "--device", "cpu"])
    assert request.method == "regression"  # at 4 steps; the method's default depends on the steps (below)
    fields = {
        "sampling_steps": request.sampling_steps,
        "adv_weight": request.adv_weight,
        "dmd_weight": request.dmd_weight,
        "distill_samples": request.samples,
        "teacher_steps": request.teacher_steps,
        "max_steps": request.max_steps,
        "batch_size": request.batch_size,
        "lr": request.lr,
        "ema_decay": request.ema_decay,
        "save_every": request.save_every,
    }
    assert fields == {
        "sampling_steps": 4,
        "adv_weight": 0.5,
        "dmd_weight": 1.0,
        "distill_samples": 4096,
        "teacher_steps": 32,
        "max_steps": 1000,
        "batch_size": 64,
        "lr": 1e-4,
        "ema_decay": 0.995,
        "save_every": 500,
    }
    for name, value in fields.items():
        assert f"(default: {value})" in help_of("distill", name), name


@pytest.mark.parametrize("steps,method", [(1, "adversarial"), (2, "adversarial"), (4, "regression"), (8, "regression")])
def test_distill_picks_the_method_measured_best_for_its_step_count_unless_one_is_named(steps, method):
    from ddpm.cli import resolve

    argv = ["--mode", "distill", "--model_path", "teacher.pt", "--device", "cpu", "--sampling_steps", str(steps)]
    assert resolve.parse(argv)[1].method == method
    assert resolve.parse([*argv, "--distill_method", "dmd"])[1].method == "dmd"
    weight = ["--adv_weight", "1"]  # read by the adversarial method, whether named or the step count's default
    if method == "adversarial":
        assert resolve.parse([*argv, *weight])[1].adv_weight == 1.0
    else:
        with pytest.raises(
            ValueError, match="--adv_weight is read by --mode distill with --distill_method adversarial"
        ):
            resolve.parse([*argv, *weight])


def test_a_students_step_counts_are_the_flags_choices():
    from ddpm.training.distill import DistillConfig

    offered = next(a for a in parser.build_parser("distill")._actions if a.dest == "sampling_steps").choices
    assert tuple(offered) == (1, 2, 4, 8)
    for steps in (*offered, 3, 16):
        config = lambda: DistillConfig(teacher="t", sampling_steps=steps, samples=1, teacher_steps=32)  # noqa: E731
        if steps in offered:
            config()
        else:
            with pytest.raises(ValueError, match="must be one of 1, 2, 4, 8"):
                config()


def test_trainings_help_shows_the_recipe_each_kind_of_data_trains_with():
    """--batch_size, --lr, --ema_decay and --min_snr_gamma depend on the data (images or volumes): the help
    names both values, the ones a run left at its defaults gets; --dataset's default is shown and used."""
    from ddpm.cli import resolve

    assert "(default: mnist)" in help_of("train", "dataset")
    _, mnist = resolve.parse(["--mode", "train", "--device", "cpu"])
    assert mnist.model.dataset == "mnist" and mnist.checkpoint == "checkpoints/mnist.pt"
    runs = {
        kind: resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", dataset])[1]
        for kind, dataset in (("images", "cifar10"), ("volumes", "spheres"))  # the digits: the CPU's recipe
    }
    assert (runs["images"].batch_size, runs["volumes"].batch_size) == (64, 16)
    for name, shown in (("batch_size", str), ("lr", "{:g}".format), ("ema_decay", str)):
        values = [shown(getattr(runs[kind], name)) for kind in ("images", "volumes")]
        assert f"(default {values[0]} images, {values[1]} volumes)" in help_of("train", name), name
    gamma = [runs["images"].min_snr_gamma or 0, runs["volumes"].min_snr_gamma]  # None: unweighted, said as 0
    assert f"(default {gamma[0]:g} images, {gamma[1]:g} volumes)" in help_of("train", "min_snr_gamma")


@pytest.mark.parametrize(
    "mode,extra,field",
    [
        ("sample", [], "batch_size"),
        ("evaluate", [], "batch_size"),
        ("train_autoencoder", [], "batch_size"),
        ("train_autoencoder", [], "lr"),
    ],
)
def test_other_modes_help_shows_the_batch_and_rate_their_request_gets(mode, extra, field):
    from ddpm.cli import resolve

    _, request = resolve.parse(["--mode", mode, "--device", "cpu", "--dataset", "digits", *extra])
    assert f"(default: {getattr(request, field)})" in help_of(mode, field)
    assert "None" not in help_of(mode, "batch_size") + help_of(mode, "dataset")


def test_help_names_the_defaults_the_code_runs_with():
    """Defaults applied past the flags (the autoencoder's shape and length, the epochs of a run without --max_steps,
    an INT8 export's calibration, the ONNX opset): the help says the values the code then uses."""
    from ddpm.formats import quantization, unet_io
    from ddpm.latent.autoencoder import AutoencoderConfig
    from ddpm.modes import train
    from ddpm.training import autoencoder_trainer

    ae = AutoencoderConfig(image_size=8, in_channels=1)
    assert f"(default {ae.latent_channels})" in help_of("train_autoencoder", "latent_channels")
    assert f"(default {ae.base_channels})" in help_of("train_autoencoder", "ae_channels")
    assert f"(default {ae.kl_weight:g})" in help_of("train_autoencoder", "kl_weight")
    steps = autoencoder_trainer.total_steps(n_epochs=None, max_steps=None, steps_per_epoch=7)
    assert f"{steps} steps" in help_of("train_autoencoder", "n_epochs")
    assert f"(default {train.TRAIN_EPOCHS} " in help_of("train", "n_epochs")
    sampler, sampler_steps = quantization.DEFAULT_CALIBRATION_SAMPLER
    assert f"(default {quantization.DEFAULT_CALIBRATION_SAMPLES})" in help_of("export", "calibration_samples")
    assert f"{sampler}, {sampler_steps} steps" in help_of("export", "calibration_samples")
    assert f"(default {sampler_steps})" in help_of("export", "sampling_steps")
    opset_help = help_of("export", "opset")
    assert (
        f"default: {unet_io.default_opset('fp32')}" in opset_help
        and f"{unet_io.default_opset('bf16')} for bf16" in opset_help
    )
