"""Train DDPMs on small images and sample them fast: the command-line entry point.

    python main.py --mode train --dataset digits --max_steps 1500          # offline, CPU-friendly
    python main.py --mode train --dataset mnist --n_epochs 10              # downloads MNIST
    python main.py --mode train_autoencoder --dataset digits               # a latent model's first stage
    python main.py --mode sample --model_path checkpoints/mnist.pt --n_samples 16 --sampler ddim
    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt        # -> checkpoints/mnist.onnx
    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    python main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --sampler ddim
    torchrun --nproc_per_node 4 main.py --mode train --dataset cifar10 --batch_size 128  # 4 GPUs (util/distributed.py)

Every mistake a user can make (a path, a size, a count, a missing dependency) ends with one line
on stderr and exit code 2; ``--help`` lists the modes, and ``--mode MODE --help`` the flags MODE reads.
No run replaces a file it should not: every output is checked before work starts (util/safe_files.py),
training onto an existing checkpoint needs --resume or --overwrite, and Ctrl-C or SIGTERM end with
one line and exit code 130 or 143 (training saves first).

This file is the entry point only: parse the flags (ddpm/cli/parser.py), resolve them into one typed
request (ddpm/cli/resolve.py), run its mode (ddpm/modes/<mode>.py), and turn what a user can cause
into one line and an exit code.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from ddpm.cli import parser
from ddpm.cli.parser import PROG

# before torch: a Ctrl-C during the first imports ends in one line too
from ddpm.util.messages import Interrupted, TrainingDiverged, install, one_line, one_line_warnings, raised_within

DISTRIBUTED_MODES = ("train", "distill", "sample", "benchmark")  # the modes that run under torchrun


def report(message: str) -> None:
    """The one error line, written whole in one call (ranks share the terminal: lines must not interleave)."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Run one mode; every failure a user can cause ends in one line on stderr and a documented exit code:
    2 for a user error (or memory exhausted), 1 for a training run that diverged, 130/143 for Ctrl-C/SIGTERM."""
    install()
    with one_line_warnings(PROG):  # a library's warning is one line too
        try:
            return _main(argv)
        except Exception as exc:  # a library's own error, raised because a signal interrupted it
            stop = raised_within(exc)
            if stop is None:
                raise
            return stopped(stop)


def run_mode(mode: str):
    """The function that runs ``mode``: ddpm/modes/<mode>.py's run_<mode>, imported only now (a run loads only
    its own mode's libraries)."""
    match mode:
        case "train":
            from ddpm.modes.train import run_train as run
        case "sample":
            from ddpm.modes.sample import run_sample as run
        case "evaluate":
            from ddpm.modes.evaluate import run_evaluate as run
        case "export":
            from ddpm.modes.export import run_export as run
        case "benchmark":
            from ddpm.modes.benchmark import run_benchmark as run
        case "train_autoencoder":
            from ddpm.modes.train import run_train_autoencoder as run
        case "distill":
            from ddpm.modes.distill import run_distill as run
        case _:
            raise ValueError(f"--mode {mode} is not available yet")
    return run


def stopped(stop: Interrupted) -> int:
    print(f"\n{PROG}: {stop.name}: stopped", file=sys.stderr)
    return stop.exit_code


def _main(argv: list[str] | None) -> int:
    try:
        args = parser.parse_args(argv)  # --help and argparse's own errors (exit 2) end here
        # torch's extension builder logs "No CUDA runtime is found" on machines without a GPU (when
        # --compile or a first-use build imports it): expected here, so not shown.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        # Imported here, under the signal handlers: a Ctrl-C while torch loads ends in one line too.
        from ddpm.cli import resolve
        from ddpm.util import distributed
        from ddpm.util.memory import is_out_of_memory

        ranks = distributed.current()  # replaced by torchrun's place once the environment is read
        try:
            ranks = distributed.from_environment()  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; one process without
            if ranks.distributed and args.mode not in DISTRIBUTED_MODES:
                raise ValueError(f"--mode {args.mode} runs in one process; start it with python, not torchrun")
            request = resolve.request_for(args)
            with distributed.session(ranks, request.device) as device:  # each rank on its own GPU
                run_mode(args.mode)(replace(request, device=device))
        except (ValueError, OSError, ImportError) as exc:  # user errors, incl. a missing build or package
            if raised_within(exc):
                raise  # a wrapped interrupt (main() ends it as one)
            report(f"{ranks.label()}{one_line(exc)}")
            return 2
        except TrainingDiverged as exc:
            report(f"{ranks.label()}{one_line(exc)}")
            return 1
        except (RuntimeError, MemoryError) as exc:
            if distributed.is_collective_failure(exc, ranks=ranks):  # another rank failed (it said why) or vanished
                report(f"{ranks.label()}stopped: the other ranks went away ({one_line(exc)[:200]})")
                return 1
            if not is_out_of_memory(exc):
                raise
            place = "GPU" if "cuda" in str(exc).lower() else "machine"
            report(f"{ranks.label()}the {place} ran out of memory; lower --batch_size or --n_samples")
            return 2
    except KeyboardInterrupt as exc:
        return stopped(exc if isinstance(exc, Interrupted) else Interrupted())
    return 0


if __name__ == "__main__":
    sys.exit(main())
