"""cli/flags.py and cli/parser.py: each mode reads its own flags (the table READ_BY), refuses the others in
one line naming the modes that read them, shows only its own in ``--mode MODE --help``, and parses without
importing torch."""

import subprocess
import sys

import pytest
from helpers import ROOT

from ddpm.choices import SAMPLERS
from ddpm.cli import parser
from ddpm.cli.flags import FLAGS, MODES, READ_BY, flags_of
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
    import main

    assert (
        set(MODES)
        == set(main.MODES)
        == {"train", "sample", "evaluate", "benchmark", "export", "train_autoencoder", "distill"}
    )
    assert all(set(READ_BY[name]) == set(MODES) for name in ("mode", "device", "seed", "precision", "model_path"))
    assert set(flags_of("distill")) == {
        *("mode", "device", "seed", "precision", "profile", "model_path", "autoencoder", "output"),
        *("sampling_steps", "guidance_scale", "distill_samples", "teacher_steps", "compile"),
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
            steps=[None],
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
        (["--implementation", "original", "--trt_opt_level", "2"], "--trt_opt_level builds a TensorRT engine"),
        (["--implementation", "onnxruntime", "--max_batch", "8"], "--max_batch builds a TensorRT engine"),
        (["--implementation", "cuda", "--opset", "21"], "--implementation cuda makes none"),
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
            resolve._refuse_unread_runtime_flags(args, args.implementation, kind="checkpoint")
        else:
            with pytest.raises(ValueError, match=refused):
                resolve.parse(argv)
