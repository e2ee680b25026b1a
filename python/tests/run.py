"""Runs python/tests/ against the extension module a cargo build made (scripts/test calls it after
building the workspace): the package folder beside a copy of the module in a temporary folder, so
nothing is installed. pytest runs the same tests where it is installed (they are unittest cases).

    python3 python/tests/run.py TARGET_DIR    (e.g. target/release, holding lib_native.so and megakernel)
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(sys.argv[1]).resolve()
    native, command = target / "lib_native.so", target / "megakernel"
    for f in (native, command):
        if not f.is_file():
            print(f"python/tests/run.py: {f} is missing: build the workspace first (scripts/test does)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "persistent_layer"
        shutil.copytree(HERE.parent / "persistent_layer", package)
        shutil.copy(native, package / "_native.abi3.so")
        sys.path[:0] = [tmp, str(HERE)]
        # The tests' own subprocesses (`python -m persistent_layer`) import the same package.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        os.environ["PL_MEGAKERNEL"] = str(command)
        suite = unittest.defaultTestLoader.discover(str(HERE), pattern="test_*.py")
        result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
