"""Ctrl-C and SIGTERM: one line, the conventional exit code, and never a cut-off save.

``main.py`` calls :func:`install` first thing, so both signals raise :class:`Interrupted` (a
``KeyboardInterrupt``) wherever the program is; ``main`` turns it into one line and exit code
128 + signal number (130 for Ctrl-C, 143 for SIGTERM). Code that must not be cut in the middle
(a file being written, a training step) runs inside :func:`deferred`: a signal arriving there is
held, and raised when the outermost deferred block ends. The training loop polls :func:`pending`
between steps, so it stops on a step boundary and saves.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

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
