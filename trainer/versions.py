"""The package versions meshppo runs on: requirements.txt's floors (`name>=version`, the one place they
are written), checked when a run starts. pip keeps an installed package that an older floor allowed, and
an older torch or transformers does not fail at import but deep in a run (the device meshes, FSDP2, the
optimizer, the fp8 kernels, the models' config): such an environment is refused in one line instead."""

from __future__ import annotations

import os
import re
from importlib import metadata

REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements.txt")
# the packages a run imports; the others in requirements.txt serve the tests, the plots or a logger
RUNTIME = ("torch", "transformers", "tokenizers", "safetensors", "numpy")


def floors(path: str = REQUIREMENTS) -> dict[str, str]:
    """`{name: version}` of each `name>=version` line of requirements.txt."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*(#.*)?$", line)
            if m:
                out[m.group(1).lower()] = m.group(2)
    return out


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: 2.10.0 of '2.10.0+cu128', '2.10.0a0+git1234' or '2.10'."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    numbers = [int(x) for x in m.group(0).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_errors(installed=None, path: str = REQUIREMENTS) -> list[str]:
    """One line for each run-time package installed below its floor in requirements.txt (none where the
    file is not beside the code, as in a copy of the packages alone). `installed(name)`: its version or None."""
    if not os.path.exists(path):
        return []
    need, installed = floors(path), installed or _installed
    errors = []
    for name in RUNTIME:
        have = installed(name)
        if name in need and have is not None and release(have) < release(need[name]):
            errors.append(f"{name} {have} is installed, meshppo needs {name}>={need[name]} (requirements.txt; "
                          f"`pip install -r requirements.txt` upgrades it)")
    return errors


def check_versions() -> int:
    """0, or 2 after printing each `meshppo: environment error: ...` line of `version_errors`."""
    import sys

    errors = version_errors()
    for line in errors:
        print(f"meshppo: environment error: {line}", file=sys.stderr)
    return 2 if errors else 0
