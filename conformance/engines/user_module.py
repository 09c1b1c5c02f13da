"""A user's class named on the command line (`--module pkg.mod:Class`): found, checked, and for
`--engine python` constructed as the engine under test (docs/engine-api.md).

The path is imported as `python -m` would, with the current directory first on sys.path, so
`--module examples.numpy_engine:NumpyEngine` works from the repository root without installing anything.
Every way the path can fail is one line that names the path and the fix.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

from conformance.engines.protocol import check_engine


class UserModuleError(ValueError):
    """--module does not name a class that can be imported (a usage error; the message names the fix)."""


class NotAnEngineError(UserModuleError):
    """The class exists but cannot serve as an engine: its constructor raised, or it lacks the protocol."""


def import_class(path: str, example: str = "mypkg.engine:MyEngine") -> type:
    """`pkg.mod:Class` (or `pkg.mod.Class`) -> the class."""
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise UserModuleError(f"--module {path!r}: give an import path like {example!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())                                  # as `python -m` does
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserModuleError(f"--module {path!r}: cannot import {mod_name!r} ({type(e).__name__}: {e}); run from "
                              f"the directory that holds it or put that directory on PYTHONPATH") from None
    if not hasattr(mod, attr):
        classes = sorted(n for n, v in vars(mod).items() if inspect.isclass(v) and v.__module__ == mod.__name__)
        raise UserModuleError(f"--module {path!r}: {mod_name} has no {attr!r} (its classes: "
                              f"{', '.join(classes) or 'none'})")
    cls = getattr(mod, attr)
    if not inspect.isclass(cls):
        raise UserModuleError(f"--module {path!r}: {mod_name}.{attr} is a {type(cls).__name__}, not a class")
    return cls


def python_engine(path: str):
    """(engine, why) for `--engine python --module path`: the class constructed with no arguments and
    checked against the Engine protocol (conformance/engines/protocol.py) before any bundle is opened."""
    cls = import_class(path)
    if any(c.__module__.startswith("torch.nn") for c in cls.__mro__):
        raise UserModuleError(f"--module {path!r}: {cls.__name__} is a torch.nn.Module (a model, not an engine): "
                              f"run it with --engine torch, or give a class that implements the Engine protocol "
                              f"(docs/engine-api.md)")
    try:
        engine = cls()
    except Exception as e:  # noqa: BLE001 - the user's constructor: any failure is reported as its own
        raise NotAnEngineError(f"--module {path!r}: {cls.__name__}() raised {type(e).__name__}: {e} (an --engine "
                              f"python class is constructed with no arguments; load() gets the bundle)") from None
    lacks = check_engine(engine)
    if lacks:
        raise NotAnEngineError(f"--module {path!r}: {cls.__name__} is not an Engine (docs/engine-api.md): "
                              f"{'; '.join(lacks)}")
    optional = [m for m in ("run_layer", "hold_routing", "ddtree_generate") if callable(getattr(engine, m, None))]
    return engine, (f"requested; {path}, {engine.dtype}, optional methods: {', '.join(optional) or 'none'}")
