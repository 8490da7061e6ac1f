"""Putting a stand-in for another library's module into sys.modules, once, without silently replacing one that is
already imported: what every ``install_*`` function of this package shares."""

from __future__ import annotations

import importlib.machinery
import sys
import types


def new_module(name: str, doc: str, package: bool = False) -> types.ModuleType:
    """A module object named ``name`` with a spec of its own (importlib.util.find_spec, which some code uses to
    ask whether a module is there, raises on a module in sys.modules whose __spec__ is None). A package gets an
    empty __path__, so that ``import name.sub`` finds the submodules put into sys.modules."""
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=__name__, is_package=package)
    if package:
        module.__path__ = []
    return module


def install_module(name: str, module: types.ModuleType, replace: bool) -> None:
    """sys.modules[name] = module, unless another module of that name is already imported and ``replace`` is
    False: code that imported that one keeps using it whatever sys.modules says, so that is an error."""
    existing = sys.modules.get(name)
    if existing is not None and existing is not module and not replace:
        where = getattr(existing, "__file__", None) or repr(existing)
        raise RuntimeError(
            f"sys.modules[{name!r}] is already another module ({where}); code that imported it keeps using it. "
            f"Pass replace=True to install deform_conv's in its place for later imports, or call this before "
            f"anything imports {name}"
        )
    sys.modules[name] = module
