"""Class-conditional sampling: which class each image is drawn as, and classifier-free guidance.

A class-conditional U-Net (``UNetConfig.num_classes`` > 0, trained with ``--class_cond``) takes a
label per image; its last label, the null label, asks for the unconditional eps (training replaces
``--cond_drop`` of the labels by it). Sampling asks for classes with ``--class_label`` and
combines the two with ``--guidance_scale`` W (Ho & Salimans 2022):

    eps = eps_uncond + W * (eps_cond - eps_uncond)      # noise_schedule.guided_eps

    labels = class_labels("3,7", class_names=("0", ..., "9"))   # -> [3, 7]
    per_image = labels_for(labels, n=16)                        # 8 x 3, then 8 x 7: one grid row each
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the command line reads this module before torch
    import torch

# Measured on the digits (BENCHMARKS.md, "Class-conditional digits"): the scale the README documents.
DEFAULT_GUIDANCE = 2.0
MAX_CLASS_NAME = 100  # characters of one class name in a checkpoint


@dataclass(frozen=True)
class Guidance:
    """What a class-conditional model is asked to draw: ``labels`` (B,) int64, one per image, and the
    guidance ``scale`` (1: the conditional model as trained, unguided; 0: its unconditional eps; above
    1: guided). Any scale but 1 runs the U-Net on the batch twice in one pass, the second copy with
    ``null_label``, and combines the halves with :func:`noise_schedule.guided_eps`."""

    labels: torch.Tensor
    null_label: int
    scale: float = 1.0

    @property
    def doubled(self) -> bool:
        return self.scale != 1.0

    def model_labels(self) -> torch.Tensor:
        """The U-Net's label input: (B,), or (2B,) with the null label for the second copy."""
        import torch

        if not self.doubled:
            return self.labels
        return torch.cat([self.labels, torch.full_like(self.labels, self.null_label)])

    def to(self, device: torch.device) -> Guidance:
        return replace(self, labels=self.labels.to(device))

    def rows(self, start: int, stop: int) -> Guidance:
        """The guidance of images ``start:stop`` (one sampling batch)."""
        return replace(self, labels=self.labels[start:stop])


def unet_batch(batch_size: int, guidance: Guidance | None) -> int:
    """The U-Net's batch for ``batch_size`` images: twice as many when guided (conditional, then null label)."""
    return 2 * batch_size if guidance is not None and guidance.doubled else batch_size


def guidance_for(
    model_config,
    class_names: tuple[str, ...],
    *,
    class_label: str | None,
    scale: float | None,
    n_samples: int,
    source: object,
) -> tuple[Guidance | None, int | None]:
    """What ``--class_label`` and ``--guidance_scale`` ask of the model of ``model_config`` (a UNetConfig)
    for ``n_samples`` images: (guidance with one label per image, grid columns), or (None, None) for an
    unconditional model, which refuses both flags (``source`` names it in the message)."""
    if not model_config.num_classes:
        if class_label is not None or scale is not None:
            raise ValueError(
                f"--class_label and --guidance_scale apply to class-conditional models (trained with --class_cond); "
                f"{source} is unconditional"
            )
        return None, None
    wanted = class_labels(class_label, class_names=class_names)
    scale = DEFAULT_GUIDANCE if scale is None else scale
    guidance = Guidance(labels=labels_for(wanted, n=n_samples), null_label=model_config.null_label, scale=scale)
    return guidance, grid_columns(wanted, n=n_samples)


def class_labels(text: str | None, *, class_names: tuple[str, ...]) -> list[int]:
    """The classes ``--class_label`` asks for: ``all`` (or None), an index, a name, or a comma list of them."""
    if not class_names:
        raise ValueError(
            "--class_label needs a class-conditional model (trained with --class_cond); this one has no classes"
        )
    if text is None or text.strip().lower() == "all":
        return list(range(len(class_names)))
    labels = []
    for item in (part.strip() for part in text.split(",")):
        if item in class_names:
            labels.append(class_names.index(item))
        elif item.lstrip("-").isdigit():
            index = int(item)
            if not 0 <= index < len(class_names):
                raise ValueError(
                    f"--class_label {item} is out of range: this model has classes 0 to {len(class_names) - 1}"
                )
            labels.append(index)
        else:
            shown = ", ".join(class_names[:12]) + (", ..." if len(class_names) > 12 else "")
            raise ValueError(f"--class_label {item!r} is not a class of this model ({shown}), nor an index")
    return labels


def labels_for(labels: list[int], *, n: int) -> torch.Tensor:
    """One label per image (n,) int64: the classes in order, each for an equal run of images
    (the first ``n % len(labels)`` runs one longer)."""
    import torch

    per, extra = divmod(n, len(labels))
    counts = [per + (i < extra) for i in range(len(labels))]
    return torch.repeat_interleave(torch.tensor(labels, dtype=torch.long), torch.tensor(counts))


def grid_columns(labels: list[int], *, n: int) -> int | None:
    """Columns that put each requested class on its own grid row, when the images split evenly."""
    if len(labels) > 1 and n % len(labels) == 0:
        return n // len(labels)
    return None


def valid_class_names(names: object, *, num_classes: int) -> bool:
    """``num_classes`` non-empty strings of at most :data:`MAX_CLASS_NAME` characters."""
    return (
        isinstance(names, (list, tuple))
        and len(names) == num_classes
        and all(isinstance(name, str) and 0 < len(name) <= MAX_CLASS_NAME for name in names)
    )


def read_class_names(state: dict, *, num_classes: int, source: str) -> tuple[str, ...]:
    """A checkpoint's class names, validated (indices as names when it has none)."""
    names = state.get("class_names") or [str(i) for i in range(num_classes)]
    if not isinstance(names, list) or not valid_class_names(names, num_classes=num_classes):
        raise ValueError(f"{source}: its class names are not {num_classes} short strings")
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:  # --class_label NAME would pick one of them silently
        raise ValueError(f"{source}: its class names hold {repeated!r} twice; each class needs its own name")
    return tuple(names)


def check_scale(scale: float) -> float:
    if not math.isfinite(scale) or not 0.0 <= scale <= 100.0:
        raise ValueError(f"--guidance_scale must be between 0 and 100, got {scale}")
    return scale
