"""Which of the project's modules one ``main.py`` call runs code in, the measure of the house issue's "a call crosses
N modules": a module counts when one of its functions runs after the imports (code that runs while modules import
does not count).

    python scripts/module_crossings.py --mode sample --model_path m.pt --n_samples 8 --output g.png
    python scripts/module_crossings.py --mode train --dataset digits --max_steps 5 --model_path t.pt --overwrite

Prints each crossed module with the functions that ran in it, then the count on stderr.
"""

import os
import runpy
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MAIN = os.path.join(ROOT, "main.py")
sys.path.insert(0, ROOT)
crossed: dict[str, set[str]] = {}


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside a module's import (a ``<module>`` frame other than main.py's below it)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and os.path.abspath(code.co_filename) not in (MAIN, os.path.abspath(__file__)):
            return True
        frame = frame.f_back
    return False


def _profile(frame, event, arg) -> None:
    if event != "call" or frame.f_code.co_name == "<module>":
        return
    if frame.f_code.co_filename.startswith("<"):  # <frozen ...>, <string>: not a file of the project
        return
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(ROOT + os.sep) or os.sep + "tests" + os.sep in path or ".venv" in path:
        return
    if not _importing(frame.f_back):
        crossed.setdefault(os.path.relpath(path, ROOT), set()).add(frame.f_code.co_name)


if __name__ == "__main__":
    sys.argv = [MAIN, *sys.argv[1:]]
    sys.setprofile(_profile)
    try:
        runpy.run_path(MAIN, run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    for name in sorted(crossed):
        print(name, " ".join(sorted(crossed[name])))
    print(f"{len(crossed)} modules crossed", file=sys.stderr)
