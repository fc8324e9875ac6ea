"""One-line messages: text a file holds reaches the terminal as data, never as terminal control."""

from __future__ import annotations

import pytest

from ddpm.util.messages import first_line, one_line, printable

# Escape sequences a hostile model file could carry: colours, a window title, clearing the screen, a carriage
# return that rewrites the line, a bell, a right-to-left override that reverses what is shown.
HOSTILE = "\x1b[31mred\x1b[0m \x1b]0;owned\x07 \x1b[2J \rfake \x07 \u202eevil \x00 \x7f"


def _safe(text: str) -> bool:
    return text.isprintable()


def test_printable_escapes_every_control_character_and_keeps_the_rest():
    text = printable(HOSTILE)
    assert _safe(text)
    assert "\\x1b[31mred" in text and "\\u202e" in text and "\\r" in text
    assert printable("plain: café, 3 × 4") == "plain: café, 3 × 4"


@pytest.mark.parametrize("render", [first_line, one_line])
def test_messages_quoting_a_files_text_are_escaped(render):
    line = render(ValueError(f"m.pt: unknown class {HOSTILE}\nsecond line \x1b[1m"))
    assert _safe(line) and "\n" not in line
    assert "unknown class" in line


def test_a_class_name_with_escapes_reaches_stderr_escaped(tmp_path):
    from helpers import perturbed_unet, run_here, tiny_unet_config

    from ddpm.formats.checkpoints import save_checkpoint
    from noise_schedule import ScheduleConfig

    model = perturbed_unet(tiny_unet_config(num_classes=2, norm_groups=8))
    weights = model.state_dict()
    save_checkpoint(
        tmp_path / "m.pt",
        {
            "format_version": 1,
            "model_config": model.config.to_dict(),
            "schedule_config": vars(ScheduleConfig(num_timesteps=50)),
            "model": weights,
            "ema": weights,
            "step": 0,
            "class_names": ["\x1b]0;owned\x07", "\x1b[2Jdog"],
        },
    )
    result = run_here("--mode", "sample", "--model_path", "m.pt", "--class_label", "bird", cwd=tmp_path)
    assert result.returncode == 2
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "\\x1b" in result.stderr  # the names are shown, escaped


def test_a_long_library_message_is_cut_after_a_whole_sentence():
    from ddpm.util.messages import clipped

    torch_says = (
        "PytorchStreamReader failed reading zip archive: failed finding central directory. This is an internal "
        "miniz error. If you are seeing this error, there is a high likelihood that your checkpoint file is "
        "corrupted. This can happen if the checkpoint was not saved properly."
    )
    assert clipped(torch_says) == (
        "PytorchStreamReader failed reading zip archive: failed finding central directory. This is an internal "
        "miniz error."
    )
    assert clipped("word " * 100, limit=22) == "word word word word..."
    assert clipped("short. text") == "short. text"


def test_a_truncated_checkpoint_is_named_in_whole_sentences(tmp_path):
    import io

    import torch

    from ddpm.formats.torch_files import load_pt

    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(100)}, buffer)
    data = buffer.getvalue()
    with pytest.raises(ValueError) as info:
        load_pt(data[: len(data) // 2], source="m.pt", kind="a checkpoint")
    assert str(info.value).endswith(".)"), str(info.value)
