"""The names a flag may take, and the defaults that more than one module reads, in one module that imports
nothing: the command line builds its parser (and ``--help``, defaults included) from these without importing
torch, and the modules that own each name or default import it from here, so each is written once.

    from ddpm.choices import PRESETS        # basic_diffusion.py, and cli/flags.py for --model_preset

Add a name here when its owner learns to handle it (an implementation in backends/registry.py, a format
in modes/export.py). noise_schedule.py and backends/registry.py keep their own lists, which
tests/test_structure.py checks against these.
"""

# noise_schedule.py's SCHEDULES and SAMPLERS: beta schedules and the samplers' update rules.
SCHEDULES = ("linear", "cosine")
SAMPLERS = ("ddpm", "ddim", "dpm_solver", "dpm_solver_sde", "consistency")
# What sample and evaluate draw with where --sampler is not given (a distilled student: its own sampler and steps),
# in its default 20 steps (docs/samplers.md). Benchmark times DDPM.
DEFAULT_SAMPLER = "dpm_solver_sde"

# basic_diffusion.py: U-Net presets and how a residual block takes the timestep.
PRESETS = ("small", "ddpm_cifar10")
TIME_CONDITIONING = ("scale_shift", "add")

# util/precision.py: autocast precisions, and quantized graphs (exported and run, never trained or autocast).
PRECISIONS = ("fp32", "bf16", "fp16")
QUANTIZED = ("int8", "fp8")
ALL_PRECISIONS = PRECISIONS + QUANTIZED

# backends/registry.py: what --implementation offers (benchmark rows: benchmarks/).
SAMPLE_IMPLEMENTATIONS = ("original", "cuda", "cuda_steps", "onnxruntime", "tensorrt")
# auto: the fastest implementation verified on the device, for the precision and model (backends/selection.py).
DEFAULT_IMPLEMENTATION = "auto"
IMPLEMENTATION_CHOICES = (DEFAULT_IMPLEMENTATION, *SAMPLE_IMPLEMENTATIONS)

# modes/export.py: what --mode export writes.
FORMATS = ("onnx", "torchscript", "tensorrt", "safetensors", "diffusers")
# formats/unet_io.py: the largest batch an exported graph or a TensorRT engine takes by default.
DEFAULT_MAX_BATCH = 64

# tensorrt_integration.py: native engines or torch_tensorrt.compile.
BACKENDS = ("native", "torch_tensorrt")
# formats/engine_cache.py: TensorRT's builder_optimization_level, 0 (fast build) .. 5 (most tactics).
OPT_LEVELS = range(6)

# training/timestep_sampling.py: which timesteps each training step draws.
TIMESTEP_SAMPLERS = ("uniform", "importance", "topk", "speed")

# The batch that sampling, evaluate and an INT8 export's calibration draw at a time (--batch_size): memory is
# that of one batch, whatever --n_samples is.
DRAW_BATCH = 64

# A new training run's recipe for images and for volumes, where --batch_size, --lr, --ema_decay and
# --min_snr_gamma are left out (cli/resolve.py applies it; --help prints it; BENCHMARKS.md, "3-D volumes").
TRAINING_DEFAULTS = {
    "images": dict(batch_size=64, lr=2e-4, ema_decay=0.999, min_snr_gamma=0.0),
    "volumes": dict(batch_size=16, lr=1e-3, ema_decay=0.995, min_snr_gamma=5.0),
}
# A new model of the handwritten digits (RECIPE_DATASETS) trained with none of these flags given: the recipe chosen
# on real digits (BENCHMARKS.md, "Real digits at 28×28"; cli/recipes.py applies it and the run says so). In pixels
# (the 8x8 digits, or another --img_size) it applies on a CPU only; a GPU keeps the preset there.
DIGITS_RECIPE = dict(model_channels=32, num_res_blocks=1, batch_size=128, lr=1.5e-3, timestep_sampling="importance")
RECIPE_DATASETS = ("digits", "mnist", "mnist_5k")
# Of those, the 28x28 digits train a latent model on any device (it drew better digits than the pixel preset in the
# same seconds on a GPU too): the run first trains a small autoencoder with this recipe (written beside the
# checkpoint as <stem>_autoencoder.pt), then the U-Net above on its latents (BENCHMARKS.md, "Real digits at 28×28").
LATENT_RECIPE_DATASETS = ("mnist", "mnist_5k")
FIRST_STAGE_RECIPE = dict(ae_channels=8, max_steps=800, batch_size=64, lr=2e-3)
LATENT_RECIPE = dict(DIGITS_RECIPE, lr=3e-3, dropout=0.0, min_snr_gamma=5.0)  # the U-Net on those latents
# --mode train's length without --max_steps: passes over the data.
TRAIN_EPOCHS = 10
# --mode train_autoencoder's recipe (images only) and the autoencoder's shape (latent/autoencoder.py's config): its
# length without --max_steps or --n_epochs (BENCHMARKS.md, "Latent diffusion"), the latent's channels, the base width
# (--ae_channels) and the KL term's weight against L1.
AUTOENCODER_DEFAULTS = dict(batch_size=64, lr=1e-3, max_steps=2000, latent_channels=4, ae_channels=32, kl_weight=1e-3)
# An INT8 export's calibration without --calibration_samples or --sampler: trajectories of the few-step sampler users
# run (formats/quantization.py).
CALIBRATION_DEFAULTS = dict(samples=16, sampler="dpm_solver_sde", sampling_steps=20)
# The ONNX opset an export writes without --opset (formats/unet_io.py says why): fp32/fp16 graphs, and bf16 graphs
# (bfloat16 convolutions need opset 22).
ONNX_OPSETS = dict(default=21, bf16=22)

# training/distill.py: the U-Net calls per image a student may be distilled for, and --mode distill's recipe
# (its flags' defaults, where they differ from --mode train's; BENCHMARKS.md, "Distillation").
STUDENT_STEPS = (1, 2, 4, 8)
# How the student learns (training/distill.py, training/distill_losses.py): the regression onto the teacher's ODE
# ends alone, or with a GAN term, or with DMD's distribution-matching term, or consistency distillation (the
# regression onto an EMA target network's x_0 at the next state of the teacher's ODE).
DISTILL_METHODS = ("regression", "adversarial", "dmd", "consistency")
# --distill_method's default per --sampling_steps (BENCHMARKS.md, "Distillation"); other step counts keep the
# regression.
DISTILL_METHOD_BY_STEPS = {1: "adversarial", 2: "adversarial", 4: "regression", 8: "regression"}
# What the adversarial method's discriminator takes for real images: the teacher's training data (as DMD2 and CTM
# do, so the student is not bounded by the ODE's ends), or the teacher's ODE ends. Default: "data" where the teacher
# records a dataset read without a download (REAL_DATA_OFFLINE), "teacher" elsewhere (cli/recipes.py's adv_real).
ADV_REAL = ("data", "teacher")
REAL_DATA_OFFLINE = ("digits", "mnist_5k", "spheres")
# The student's noise levels sigma = sqrt((1 - abar) / abar) after its first call at t = T - 1, per --sampling_steps,
# for images NOISE_LEVEL_SIDE pixels a side; a side s takes them times s / NOISE_LEVEL_SIDE (the same content is less
# destroyed by the same sigma at a higher resolution: the shift of simple diffusion, Hoogeboom et al. 2023).
# training/distill.py's spaced_timesteps maps them to the schedule's nearest timesteps; a step count not listed takes
# the even spacing, T (S - i) / S - 1 (BENCHMARKS.md, "One and two calls").
STUDENT_NOISE_LEVELS = {2: (0.83,)}
NOISE_LEVEL_SIDE = 8
# --max_steps of --mode distill per --sampling_steps where it is not given (DISTILL_DEFAULTS["max_steps"] elsewhere):
# the adversarial term of 1- and 2-call students kept improving past 1,000 steps.
DISTILL_MAX_STEPS_BY_STEPS = {1: 3000, 2: 3000}
DISTILL_DEFAULTS = {
    "sampling_steps": 4,
    "adv_weight": 0.5,  # the GAN term's gradient at the student's output, as a share of the regression's
    "dmd_weight": 1.0,  # the distribution-matching term beside the regression
    "distill_samples": 4096,  # teacher trajectories the student learns from
    "teacher_steps": 32,  # teacher solver steps per trajectory
    "max_steps": 1000,
    "batch_size": 64,
    "lr": 1e-4,
    "ema_decay": 0.995,
    "save_every": 500,
}
