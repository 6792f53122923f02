"""Every third-party module the package imports is a declared dependency (pyproject.toml), so a fresh install works."""
import ast
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import sys
from pathlib import Path

import tomllib

import timm_affinediv

ROOT = Path(__file__).resolve().parent.parent


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r'[<>=!~\[; ]', req, maxsplit=1)[0].lower().replace('_', '-') for req in requirements}


def _declared() -> tuple[set[str], set[str]]:
    """The core dependencies, and those of the user-facing extras (the dev extra is for this repository only)."""
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    extras = project.get('optional-dependencies', {})
    return _names(project['dependencies']), _names([r for name, reqs in extras.items() if name != 'dev' for r in reqs])


def _imported_top_levels(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names imported when the module loads, and those imported inside its functions only."""
    tree = ast.parse(path.read_text())

    def names(nodes) -> set[str]:
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name.split('.')[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split('.')[0])
        return found
    at_load = names(tree.body)
    return at_load, names(ast.walk(tree)) - at_load


def test_every_module_imports_and_its_third_party_imports_are_declared():
    core, extras = _declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in pkgutil.walk_packages(timm_affinediv.__path__, 'timm_affinediv.'):
        if module.name.endswith('.__main__'):  # runs the command line when imported: read, not run
            path = Path(importlib.util.find_spec(module.name).origin)
        else:
            path = Path(importlib.import_module(module.name).__file__)  # every module imports
        at_load, in_functions = _imported_top_levels(path)
        for names, declared in ((at_load, core), (in_functions, core | extras)):
            for name in names:
                if name in sys.stdlib_module_names or name == 'timm_affinediv':
                    continue
                dists = {d.lower().replace('_', '-') for d in distributions.get(name, [name])}
                if not dists & declared:
                    undeclared.setdefault(name, []).append(module.name)
    assert not undeclared, f'imported but not declared in pyproject.toml: {undeclared}'
