"""`pip install -e .` finds the package from the parent of a clone named `infinity` (there the clone folder, with no
__init__.py, is a namespace package candidate). Built as pip builds it (the build backend's build_editable, the C
core included) from a copy of this checkout named `infinity`, installed by unpacking the wheel into a site folder
and run from the copy's parent with none of this environment's own .pth files, so only the built wheel can put the
package on the path ([Note: editable install] in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "aio_csrc", "infinity"]


def test_a_clone_named_infinity_does_not_shadow_the_install(tmp_path):
    clone = tmp_path / "infinity"
    clone.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
        else:
            shutil.copy2(source, clone / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")}
    build = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])",
         str(tmp_path / "wheel")],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    site_folder = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site_folder)
    # -S: no .pth of this environment (its own install of infinity); its packages (torch) without them
    packages = [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    # find_spec: the module `import infinity` would load, without importing torch (seconds); a namespace package,
    # the bug (`module 'infinity' has no attribute 'initialize'`), has no origin
    code = (f"import importlib.util, site, sys; sys.path += {packages!r}; site.addsitedir({str(site_folder)!r}); "
            "print(importlib.util.find_spec('infinity').origin)")  # fmt: skip
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(clone / "infinity" / "__init__.py"), run.stdout
