"""One-line messages: what a user reads when something they can cause goes wrong.

    raise ValueError(f"{path} cannot be read ({first_line(exc)})") from exc
    print(f"main.py: error: {one_line(exc)}")

Errors a user can cause end in one line on stderr (main.py); library code quotes the first line of
an exception it wraps, and sizes in binary units. Warnings, ours or a library's, print as one line
each, once (:func:`one_line_warnings`). Every line these helpers give is :func:`printable`: text a model
file holds (class names, config values) may be quoted in a message, never acted on by the terminal.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters such as ESC, BEL or CR,
    and other unprintable ones) written as its Python escape (``\\x1b``): what a file says reaches the
    terminal as data, never as colours, a window title or a rewritten line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _lines(exc: BaseException) -> list[str]:
    return [printable(line.strip()) for line in str(exc).splitlines() if line.strip()]


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an exception's message (its type name if there is none)."""
    lines = _lines(exc)
    return lines[0] if lines else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """The whole message of an exception on one line (its lines joined by "; ")."""
    return "; ".join(_lines(exc)) or type(exc).__name__


def clipped(text: str, *, limit: int = 200) -> str:
    """``text`` within ``limit`` characters, cut after its last whole sentence that fits (else its last whole
    word, with an ellipsis): a library's long explanation quoted without ending mid-sentence."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = head.rfind(". ")
    if end > 0:
        return head[: end + 1]
    return head.rsplit(" ", 1)[0].rstrip(",;:") + "..."


def format_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def format_seconds(seconds: float) -> str:
    """'45 s', '3 min 20 s', '1 h 05 min'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """While inside, every warning (a library's included) prints as ``prog: warning: <first line>``, once per
    text, instead of Python's two lines with a file name and source line; the previous handling comes back after."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = first_line(message if isinstance(message, BaseException) else Exception(str(message)))
        if text not in seen:
            seen.add(text)
            (file or sys.stderr).write(f"{prog}: warning: {text}\n")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
