"""Where a peer's own code says something: its installed files, read as text (never imported here), so a
refusal or a defect is named by the file and line of the release that is installed, not by a copy of it.

`package_root` finds a top-level package without importing it (importlib's finder only), so the parent
answers "not installed" in well under a second; `SourceLine.read` finds a line by a pattern and returns its
text (the pattern's group) and `path:line`; `peer_frame` picks the deepest frame of a traceback that lies in a
peer's package.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path


def package_root(module: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Located:
    """A line of a peer's installed source: what it says and where (`package/file.py:line`)."""

    text: str
    location: str


@dataclass(frozen=True)
class SourceLine:
    """A line to find in a peer's installed source: `module`'s file `path` (relative to the package), the first
    line matching `pattern`, whose group 1 (or the whole match) is what it says. A pattern may span lines
    (re.S): the line number is that of the match's start."""

    module: str
    path: str
    pattern: str

    def read(self) -> Located | None:
        root = package_root(self.module)
        if root is None:
            return None
        return find(root / self.path, self.pattern, f"{self.module}/{self.path}")


def find(file: Path, pattern: str, name: str | None = None) -> Located | None:
    """The first match of `pattern` in `file` (None if the file or the match is missing)."""
    try:
        text = file.read_text()
    except OSError:
        return None
    match = re.search(pattern, text, re.S | re.M)
    if match is None:
        return None
    line = text.count("\n", 0, match.start()) + 1
    said = match.group(1) if match.groups() else match.group(0)
    return Located(" ".join(said.split()), f"{name or file}:{line}")


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def peer_frame(traceback: str, module: str) -> Located | None:
    """The deepest frame of `traceback` inside `module`'s installed package: its source line and
    `module/relative/path.py:line in function`."""
    root = package_root(module)
    if root is None or not traceback:
        return None
    found = None
    for path, line, func, code in _FRAME.findall(traceback):
        try:
            rel = Path(path).resolve().relative_to(root.resolve())
        except ValueError:
            continue
        found = Located(code.strip(), f"{module}/{rel}:{line} in {func}")
    return found
