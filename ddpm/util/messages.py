"""One-line messages and one-line ends: what a user reads when something they can cause goes wrong, or when
they stop a run.

    raise ValueError(f"{path} cannot be read ({first_line(exc)})") from exc
    print(f"main.py: error: {one_line(exc)}")
    with deferred():          # a save: Ctrl-C or SIGTERM arriving here is raised once the block ends
        ...

Errors a user can cause end in one line on stderr (main.py); library code quotes the first line of
an exception it wraps, and sizes in binary units. Warnings, ours or a library's, print as one line
each, once (:func:`one_line_warnings`). Every line these helpers give is :func:`printable`: text a model
file holds (class names, config values) may be quoted in a message, never acted on by the terminal.

``main.py`` calls :func:`install` first, so Ctrl-C and SIGTERM raise :class:`Interrupted` (a ``KeyboardInterrupt``)
wherever the program is; ``main`` ends it in one line with exit code 128 + the signal number (130, 143). Code that
must not be cut in the middle (a file being written, a training step) runs inside :func:`deferred`; the training
loop polls :func:`pending` between steps, so it stops on a step boundary and saves.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
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


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_depth = 0  # how many deferred() blocks are open
_pending: list[int] = []  # signals received inside them, in order


class Interrupted(KeyboardInterrupt):
    """The program was asked to stop by a signal (SIGINT: Ctrl-C, or SIGTERM)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name


class TrainingDiverged(RuntimeError):
    """A training run learned nothing usable (its loss stayed non-finite); the last good checkpoint is left
    untouched, and main.py ends the run in one line with exit code 1."""


def _handler(signum: int, frame) -> None:
    if _depth > 0:
        _pending.append(signum)
        return
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install() -> None:
    """Route SIGINT and SIGTERM to :class:`Interrupted` (main thread only; idempotent)."""
    if _in_main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handler)


def raised_within(exc: BaseException) -> Interrupted | None:
    """The Ctrl-C or SIGTERM behind ``exc``, if one is in its chain of causes and contexts: a library that
    was interrupted mid-import or mid-call may raise its own error instead (torch.export's
    TorchExportError, an AttributeError from a half-imported module), which must still end as an interrupt."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc if isinstance(exc, Interrupted) else Interrupted()
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def pending() -> int | None:
    """The first signal held by an open :func:`deferred` block, or None."""
    return _pending[0] if _pending else None


@contextlib.contextmanager
def deferred(*, reraise: bool = True) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends; the outermost block then raises the first one
    (or, with ``reraise=False``, drops them: for the save that a first signal asked for).

    Works without :func:`install` too: the handlers are set for the block (main thread only).
    """
    global _depth
    previous = None
    if _depth == 0 and _in_main_thread() and signal.getsignal(signal.SIGINT) is not _handler:
        previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    _depth += 1
    try:
        yield
    except BaseException:
        if _depth == 1:
            _pending.clear()  # the block ends with its own exception; a held signal adds nothing
        raise
    finally:
        _depth -= 1
        if previous is not None:
            for sig, old in previous.items():
                signal.signal(sig, old)
    if _depth == 0 and _pending:
        if reraise:
            raise_if_pending()
        _pending.clear()


def raise_if_pending() -> None:
    """Raise the first held signal as :class:`Interrupted` (and forget the held ones); else nothing."""
    if _pending:
        signum = _pending[0]
        _pending.clear()
        raise Interrupted(signum)
