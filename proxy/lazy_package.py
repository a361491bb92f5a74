"""Enter a third-party package without running its ``__init__``, when egresswall needs a few of its submodules
and the ``__init__`` imports all the others, or none of it at all (``proxy/mitm_core.py``: mitmproxy's addons,
and ruamel.yaml, which mitmproxy imports for options files; ``proxy/aiohttp_web.py``: aiohttp's server
without its client).

The package's module object is made from its own spec (same name, same ``__path__``, so submodules import
as ever) and put in ``sys.modules``; its ``__init__`` runs the first time something asks the package for a
name that is not a submodule. So nothing about the package changes, only when its ``__init__`` runs: code
elsewhere in the process that uses the package's own names (tests, mitmdump's code) gets the whole package,
once. (The standard library's ``importlib.util.LazyLoader`` does not do here: on Python 3.12 an ``import``
of a module already in ``sys.modules`` reads its ``__spec__``, and that runs it.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def enter_package_lazily(name: str, **attributes: object) -> bool:
    """Put ``name`` in ``sys.modules`` without running its ``__init__``; ``attributes`` are names its submodules
    take from the package itself at import (``from . import __version__``), set beforehand. False (and nothing
    done) when the package is already imported or is not a package as expected: it imports the ordinary way."""
    if name in sys.modules:
        return False  # already imported, whole: nothing to save
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    package = importlib.util.module_from_spec(spec)
    for key, value in attributes.items():
        setattr(package, key, value)

    def __getattr__(attribute: str) -> object:
        if attribute.startswith("__"):
            raise AttributeError(attribute)  # probes for __wrapped__, __file__... need not run the __init__
        if importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")  # a submodule: that one only
        _run_init(package)  # a name the package itself defines: run its __init__ now, once
        return getattr(package, attribute)

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(importlib.import_module(parent), child, package)
    return True


def _run_init(package: ModuleType) -> None:
    del package.__getattr__
    assert package.__spec__ is not None and package.__spec__.loader is not None
    package.__spec__.loader.exec_module(package)
