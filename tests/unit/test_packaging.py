"""What a plain `pip install .` puts in site-packages: every file the code reads at run time.
`make bootstrap` installs in editable mode, where a file left out of the wheel is still found: a
review (stop 60) found the notebook widget's JavaScript missing from a plain install (its
package-data pattern named the top package, and patterns do not reach sub-packages)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport, as workbench.cli.configfile reads TOML
    import tomli as tomllib

ROOT = Path(__file__).parents[2]
PACKAGES = ("optim", "swarm", "workbench", "tui")


def test_every_data_file_of_the_packages_is_in_the_wheel() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    ]
    assert data, "no data files found: the layout changed, update this test"
    for path in data:
        package = ".".join(path.parent.relative_to(ROOT).parts)  # patterns match in their package's folder
        patterns = declared.get(package, [])
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), (
            f"{path.relative_to(ROOT)} is not in [tool.setuptools.package-data] {package!r} (has {patterns})"
        )
