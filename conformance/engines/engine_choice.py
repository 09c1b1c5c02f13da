"""The built-in engines `kdtr verify --engine` can run, and how `auto` picks one."""
from __future__ import annotations

import importlib.util

from conformance.engines.reference_engine import ReferenceEngine
from conformance.engines.user_module import NotAnEngineError, UserModuleError, python_engine

ENGINES = ("cuda", "python", "reference", "torch")


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here (no GPU, no pycuda, no torch for --engine torch)."""


class EngineOptionError(ValueError):
    """An engine option given to an engine that has no such option (a usage error)."""


def _cuda_engine_class():
    """cuda_engine.engine.CudaEngine when pycuda imports and a device answers; else (None, why)."""
    if importlib.util.find_spec("pycuda") is None:
        return None, "pycuda is not installed (pip install -e '.[cuda]')"
    try:
        import pycuda.driver as drv

        drv.init()
        if drv.Device.count() == 0:
            return None, "no CUDA device"
    except Exception as e:  # noqa: BLE001 - any driver failure means: no usable GPU here
        return None, f"CUDA driver unavailable ({type(e).__name__}: {e})"
    from cuda_engine.engine import CudaEngine

    return CudaEngine, "a CUDA device and pycuda are present"


def _torch_engine(dtype: str | None, module: str | None):
    """The torch engine (conformance/engines/torch_engine.py), imported only now: torch is an optional extra."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineUnavailable(f"--engine torch needs {' and '.join(missing)}: pip install -e '.[torch]' "
                                f"(install the CPU wheel first: pip install torch==2.13.0)")
    from conformance.engines.torch_engine import TorchEngine, TorchEngineError

    try:
        e = TorchEngine(dtype or "float32", module)
    except TorchEngineError as err:                                      # a --module that is not a port
        raise EngineOptionError(str(err)) from None
    return e, f"requested; {e.describe()}"


def _python_engine(module: str | None):
    """A user's class implementing the Engine protocol itself (docs/engine-api.md)."""
    if not module:
        raise EngineOptionError("--engine python runs your own engine class: name it with --module "
                                "PKG.MOD:CLASS (e.g. --module examples.numpy_engine:NumpyEngine)")
    try:
        return python_engine(module)
    except NotAnEngineError as e:
        raise EngineUnavailable(str(e)) from None
    except UserModuleError as e:
        raise EngineOptionError(str(e)) from None


def pick_engine(name: str, dtype: str | None = None, module: str | None = None, w4a16: str | None = None,
                ddtree: dict | None = None):
    """(engine instance, why it was chosen). `auto`: cuda when it can run, else reference. `dtype` and
    `module` configure the torch engine (its compute dtype, a user module's import path); `module` names
    the class of --engine python (its dtype is its own); `w4a16` the CUDA engine's INT4 kernels (fast,
    plain, dense); `ddtree` the live DDTree's budget (docs/ddtree.md §3a): {"budget": "fixed" | "cost-aware",
    "costs": {rows: cost} or None, "draft_cost": float}, for the CUDA engine (costs measured where not given)
    or the reference (costs given: CostAwareReference)."""
    if name == "python":
        if dtype:
            raise EngineOptionError("--dtype applies to --engine torch; an --engine python class declares its "
                                    "own compute dtype (its `dtype` attribute)")
    elif (dtype or module) and name != "torch":
        raise EngineOptionError(f"--dtype and --module apply to --engine torch (--module also to --engine "
                                f"python), not to --engine {name}")
    if w4a16 and name not in ("cuda", "auto"):
        raise EngineOptionError(f"--w4a16 applies to --engine cuda (or auto) only, not to --engine {name}")
    if ddtree and ddtree.get("budget") == "cost-aware":
        return _cost_aware(name, w4a16, ddtree)
    if ddtree and (ddtree.get("costs") or ddtree.get("draft_cost")):
        raise EngineOptionError("--ddtree-costs and --ddtree-draft-cost price the cost-aware budget: add "
                                "--ddtree-budget cost-aware")
    if name == "torch":
        return _torch_engine(dtype, module)
    if name == "python":
        return _python_engine(module)
    if name == "reference":
        return ReferenceEngine(), "requested; the refmodel in float32"
    if name == "cuda":
        cls, why = _cuda_engine_class()
        if cls is None:
            raise EngineUnavailable(f"--engine cuda cannot run here: {why}; use --engine reference")
        return cls(w4a16=w4a16), why
    if name == "auto":
        cls, why = _cuda_engine_class()
        if cls is not None:
            return cls(w4a16=w4a16), f"auto: {why}"
        if w4a16:       # the reference engine would run and pass, judging nothing the option asked for
            raise EngineOptionError(f"--w4a16 {w4a16} configures the CUDA engine, but auto picks the reference "
                                    f"engine here ({why}): run where the CUDA engine can, or drop --w4a16")
        return ReferenceEngine(), f"auto: no CUDA engine ({why}), so the refmodel in float32"
    raise EngineUnavailable(f"unknown engine {name!r}; choose one of auto, {', '.join(ENGINES)}")


def _cost_aware(name: str, w4a16, ddtree: dict):
    """The engine of pick_engine with the cost-aware budget (its engine options already checked): the CUDA
    engine (its own measured prices unless costs are given) or the reference (given costs only: it has no GPU
    times to measure)."""
    costs, draft = ddtree.get("costs"), float(ddtree.get("draft_cost") or 0.0)
    if name in ("cuda", "auto"):
        cls, why = _cuda_engine_class()
        if cls is not None:
            from cuda_engine.device import CudaEngineError

            try:
                e = cls(w4a16=w4a16, ddtree_budget="cost-aware", ddtree_costs=costs, ddtree_draft_cost=draft)
            except CudaEngineError as err:
                raise EngineOptionError(str(err)) from None
            how = "given verify costs" if costs else "verify costs measured on this GPU"
            return e, f"{'auto: ' if name == 'auto' else ''}{why}; cost-aware DDTree budget, {how}"
        if name == "cuda":
            raise EngineUnavailable(f"--engine cuda cannot run here: {why}; use --engine reference")
    if name not in ("reference", "auto"):
        raise EngineOptionError(f"--ddtree-budget cost-aware applies to --engine cuda and --engine reference, "
                                f"not to --engine {name}")
    if w4a16:           # the reference would run and pass, judging nothing --w4a16 asked for
        raise EngineOptionError(f"--w4a16 {w4a16} configures the CUDA engine, but the cost-aware budget runs on the "
                                f"reference engine here: run where the CUDA engine can, or drop --w4a16")
    if not costs:
        raise EngineOptionError("--ddtree-budget cost-aware on the reference engine needs --ddtree-costs (it has "
                                "no GPU times of its own to measure), e.g. --ddtree-costs 1:1,2:1.54,33:10.54")
    from conformance.engines.reference_engine import CostAwareReference

    return CostAwareReference(costs, draft), ("requested; " if name == "reference" else "auto: no CUDA engine; ") + \
        "the refmodel in float32 with the cost-aware DDTree budget, given verify costs"
