"""torch's dynamo-disabling wrappers without importing torch._dynamo until something compiles.

torch.optim wraps Optimizer methods in `torch._disable_dynamo` (add_param_group, which every
optimizer's constructor calls, zero_grad, state_dict, load_state_dict, the functional kernels
such as `adam`) and each `step` in `_use_grad_for_differentiable`; DeepSpeed does the same to
ZeRO-3's hooks, with `torch._disable_dynamo` and `torch.compiler.disable`. Each imports
torch._dynamo at its first call (or, for torch.compiler.disable, when it decorates), only to tell
dynamo not to trace the function or to break its graph there. That import is 2-3 CPU-s here
(torch 2.13): 90% of a rank's engine build for the demo's model, paid by every new rank's
process and every replacement.

While torch._dynamo is not imported no frame of the process can be under compilation, so until
then these calls run the plain function. When something imports torch._dynamo (a user's
torch.compile), right after its import and before anything can compile, every deferred wrapper
is given what torch's own would have made (`torch._dynamo.disable(fn)`), and the decorators are
torch's again: from then on torch's behaviour, as if none of this had run.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import weakref
from typing import Any, Callable

DYNAMO = "torch._dynamo"
CACHE = "__dynamo_disable"  # where torch's _disable_dynamo wrapper caches its disabled function
_deferred: weakref.WeakSet = weakref.WeakSet()  # what gets torch's disabled function at dynamo's import
_originals: dict[str, Callable] = {}  # torch's decorators, put back at dynamo's import


class _UntilDynamo:
    """Stands in `fn.__dynamo_disable`, the cache torch's `_disable_dynamo` wrapper looks in
    before it imports torch._dynamo: the plain `fn` while torch._dynamo is not imported; at its
    import, torch's own `torch._dynamo.disable(fn)` takes its place (`_give_torch_back`)."""

    def __init__(self, fn: Callable, recursive: bool):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if DYNAMO in sys.modules:  # imported some other way than the hook saw: torch's, now
            self.make_torchs()
            return getattr(self.fn, CACHE)(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def make_torchs(self) -> None:
        import torch._dynamo

        # (setattr: inside a class, `self.fn.__dynamo_disable` would be name-mangled)
        setattr(self.fn, CACHE, torch._dynamo.disable(self.fn, self.recursive, wrapping=False))


def _lazy_compiler_disable(original: Callable) -> Callable:
    """`torch.compiler.disable` that makes torch's disabled function at torch._dynamo's import
    instead of when it decorates. A function only: a module or class goes to torch's."""
    import inspect

    @functools.wraps(original)
    def disable(fn: Any = None, recursive: bool = True, **kwargs: Any) -> Any:
        if DYNAMO in sys.modules or not (fn is None or inspect.isfunction(fn) or inspect.ismethod(fn)):
            return original(fn, recursive, **kwargs)
        if fn is None:  # @torch.compiler.disable(recursive=...)
            return functools.partial(disable, recursive=recursive, **kwargs)
        torchs: list[Callable] = []

        @functools.wraps(fn)
        def until_dynamo(*args: Any, **kw: Any) -> Any:
            if not torchs and DYNAMO not in sys.modules:
                return fn(*args, **kw)
            if not torchs:
                until_dynamo.make_torchs()
            return torchs[0](*args, **kw)

        until_dynamo.make_torchs = lambda: torchs or torchs.append(original(fn, recursive, **kwargs))
        _deferred.add(until_dynamo)
        return until_dynamo

    disable.__airay_until_dynamo__ = True
    return disable


def _plain_step(step: Callable) -> Callable:
    """An optimizer's `step` as `_use_grad_for_differentiable` runs it (grad mode as the
    optimizer's `differentiable` says), without its graph breaks while nothing compiles; torch's
    own once torch._dynamo is imported."""
    import torch

    func = step.__wrapped__

    @functools.wraps(func)
    def plain_step(*args: Any, **kwargs: Any) -> Any:
        if DYNAMO in sys.modules:
            return step(*args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    return plain_step


def _closure(fn: Callable) -> dict[str, Any]:
    env = {}
    for name, cell in zip(fn.__code__.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            env[name] = cell.cell_contents
        except ValueError:  # a cell not filled yet
            pass
    return env


def _give_torch_back() -> None:
    """torch._dynamo is imported: every deferred wrapper gets torch's disabled function now (not
    at its first call, which may be under compilation), and the decorators are torch's again."""
    import torch
    import torch.compiler

    for deferred in list(_deferred):
        deferred.make_torchs()
    _deferred.clear()
    if "_disable_dynamo" in _originals:
        torch._disable_dynamo = _originals.pop("_disable_dynamo")
    if "compiler.disable" in _originals:
        torch.compiler.disable = _originals.pop("compiler.disable")


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Runs _give_torch_back right after torch._dynamo's module has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_give_back(module: Any) -> None:
            exec_module(module)
            _give_torch_back()

        spec.loader.exec_module = exec_then_give_back
        return spec


SCANNED = ("torch.optim", "deepspeed")  # modules whose wrappers may exist before defer_dynamo runs


def defer_dynamo() -> int:
    """Defer torch._dynamo's import in torch's and DeepSpeed's dynamo-disabling wrappers until
    something else imports it: call it before the process builds its first optimizer. Returns how
    many wrappers and decorators it changed (0 where torch._dynamo is imported already, or on a
    second call)."""
    import torch
    import torch._compile
    import torch.compiler
    import torch.optim
    from torch.optim import optimizer as optimizer_module

    if DYNAMO in sys.modules or "_disable_dynamo" in _originals:  # nothing to defer, or done already:
        return 0  # wrappers made since are deferred as they are made (a rank calls this at every join)
    disable_code = torch._compile._disable_dynamo(lambda: None).__code__
    use_grad_code = optimizer_module._use_grad_for_differentiable(lambda: None).__code__
    changed = 0

    def defer(wrapper: Any) -> None:
        nonlocal changed
        if getattr(wrapper, "__code__", None) is not disable_code:
            return
        env = _closure(wrapper)
        fn = env.get("fn")
        if callable(fn) and not hasattr(fn, CACHE):
            until = _UntilDynamo(fn, env.get("recursive", True))
            setattr(fn, CACHE, until)
            _deferred.add(until)
            changed += 1

    def visit(fn: Any) -> None:
        fn = getattr(fn, "__func__", fn)  # staticmethod, classmethod
        if not hasattr(fn, "__code__"):
            return
        defer(fn)
        for inner in _closure(fn).values():  # a wrapper around one (torch.optim's maybe_fallback)
            defer(inner)

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(SCANNED):
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, type):
                visit(value)
                continue
            for attr_name, attr in list(vars(value).items()):
                visit(attr)
                if attr_name == "step" and getattr(attr, "__code__", None) is use_grad_code \
                        and hasattr(attr, "__wrapped__") and issubclass(value, torch.optim.Optimizer):
                    setattr(value, "step", _plain_step(attr))
                    changed += 1
    if "_disable_dynamo" not in _originals:  # wrappers made from now on (DeepSpeed's, as it imports)
        original = _originals["_disable_dynamo"] = torch._disable_dynamo

        def disable_dynamo(fn: Any = None, recursive: bool = True) -> Any:
            if fn is None:
                return functools.partial(disable_dynamo, recursive=recursive)
            wrapper = original(fn, recursive)
            defer(wrapper)
            return wrapper

        torch._disable_dynamo = disable_dynamo
        changed += 1
    if "compiler.disable" not in _originals:
        _originals["compiler.disable"] = torch.compiler.disable
        torch.compiler.disable = _lazy_compiler_disable(torch.compiler.disable)
        changed += 1
    if not any(isinstance(f, _OnDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDynamoImport())
    return changed
