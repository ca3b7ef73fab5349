"""Loading .pt/.bin files without running pickled code.

`load_torch_file` uses `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers.
A file that needs arbitrary classes (a whole pickled model) is refused unless the caller passes
`trust_pickle=True` (the CLI's `--trust-pickle`).

`load_torch_pickle` reads whole pickled models (SVD-LLM, Dobi-SVD: `torch.save({'model': model,
'tokenizer': tok})`) without importing or running any of their code: a restricted unpickler, handed to
`torch.load` as its `pickle_module`, turns every class it does not know into an inert `Stub` that only
records its pickled state, and calls nothing but an allow-list of tensor-rebuild functions and plain
containers. A pickle that calls anything else (a `__reduce__` to `os.system`, `builtins.eval`, an unknown
factory) is refused before the call happens. `stub_tensors` then walks the `_modules` / `_parameters` /
`_buffers` of the stubs (or of real modules, under `trust_pickle`) into a flat state dict.
"""

from __future__ import annotations

import _compat_pickle
import collections
import pickle
import re
import warnings
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from rankserve.workers.checkpoint import CheckpointError

TRUST_HINT = "re-run with --trust-pickle only if you trust where the file came from"


# what a corrupt, truncated or foreign file raises from inside torch.load / pickle
_READ_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError, KeyError,
                IndexError, OverflowError, MemoryError, ImportError)
_NEEDS_CODE = ("Unsupported global", "GLOBAL ", "Unsupported class")  # torch's weights-only refusals of a callable


def load_torch_file(path: str | Path, trust_pickle: bool = False) -> Any:
    """A .pt/.bin of tensors and plain containers (`torch.load(weights_only=True)`); anything else is refused
    unless `trust_pickle`, then loaded with `weights_only=False`. Errors are one-line `CheckpointError`s."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        with warnings.catch_warnings():  # torch warns about legacy pickle protocols on stderr
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except _READ_ERRORS as e:
        if not any(s in str(e) for s in _NEEDS_CODE):
            raise CheckpointError(f"{path} is not a readable torch file ({_reason(e)})") from None
        if not trust_pickle:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))  # the callable the pickle asks for, when torch names it
            what = f" (it calls {found[1]})" if found else ""
            raise CheckpointError(f"{path} needs arbitrary pickled code to load{what}; refusing. "
                                  "Pass --trust-pickle only if you trust its source") from None
    return _load_trusted(path)


def _load_trusted(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except _READ_ERRORS as e:  # ImportError: the pickle names a module this environment lacks
        raise CheckpointError(f"{path} is not a readable torch pickle ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    """One short line from an exception torch or pickle raised (theirs run over several lines)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # the weights-only unpickler's own explanation follows a long preamble
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if not lines:
        return "empty or truncated" if isinstance(e, EOFError) else type(e).__name__
    line = lines[0].split(". ")[0][:200]
    return line if isinstance(e, (pickle.UnpicklingError, RuntimeError)) else f"{type(e).__name__}: {line}"


# --- the restricted unpickler ----------------------------------------------------------------------

class Stub:
    """Inert stand-in for a pickled object whose class we do not import; it only records its state.

    `stub_name` is the pickled class path (`component.svd_llama.SVD_LlamaAttention`). Pickle may create
    one with `cls.__new__` (NEWOBJ) and fill it through `__setstate__`, `__setitem__` and `append`;
    calling the class (REDUCE, i.e. running its constructor) is refused.
    """

    stub_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Stub":
        return object.__new__(cls)  # the constructor arguments are dropped: nothing of the class runs

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _NeedsCode(self.stub_name)  # only reached when the pickle *calls* the class

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            for part in state:  # (__dict__, __slots__ state)
                self.__dict__.update(part or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["__stub_state__"] = state

    def __setitem__(self, key: Any, value: Any) -> None:  # a dict subclass's items (SETITEMS)
        self.__dict__.setdefault("__stub_items__", {})[key] = value

    def append(self, value: Any) -> None:  # a list subclass's items (APPENDS)
        self.__dict__.setdefault("__stub_list__", []).append(value)

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def __repr__(self) -> str:
        return f"<Stub {self.stub_name}>"


def _stub_class(module: str, name: str) -> type[Stub]:
    """A fresh `Stub` subclass standing in for the class (or function) `module.name`, which is never imported."""
    return type(name, (Stub,), {"stub_name": f"{module}.{name}", "__module__": __name__})


class _NeedsCode(pickle.UnpicklingError):
    """The pickle calls something outside the allow-list; `args[0]` names it."""


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None) -> torch.Tensor:
    # hooks and metadata dropped: a weight needs neither, and hooks would be callables from the file
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"tensor rebuilt from a {type(storage).__name__}, not a storage")
    return torch._utils._rebuild_tensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_tensor(storage, storage_offset, size, stride) -> torch.Tensor:
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *state) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError(f"parameter rebuilt from a {type(data).__name__}, not a tensor")
    return data  # a plain tensor is all an importer needs


def _rebuild_from_type_v2(func, new_type, args, state) -> torch.Tensor:
    # a tensor carrying extra attributes (HF marks buffers `_is_hf_initialized`): rebuild it, drop the rest
    if func not in _REBUILDERS:
        raise _NeedsCode(getattr(func, "stub_name", repr(func)))
    return func(*args)


def _reconstructor(cls, base, state):
    # copyreg._reconstructor (pickle protocols 0/1): only `object.__new__` of a stub class is allowed
    if not (isinstance(cls, type) and issubclass(cls, Stub)) or base is not object or state is not None:
        raise _NeedsCode("copyreg._reconstructor")
    return object.__new__(cls)


def _kernel_func(module_name: Any, func_name: Any) -> Stub:
    # the `kernels` package (imported by transformers >= 5.25) pickles a function it wrapped as an nn.Module (an
    # activation, say) as this call, which would import `module_name`: an inert stub of that name stands in instead
    if not (isinstance(module_name, str) and isinstance(func_name, str)):
        raise _NeedsCode("kernels._internals.layer.layer._rebuild_kernel_func")
    return object.__new__(_stub_class(module_name, func_name))


def _plain_dict(*args, **kwargs) -> dict:
    return {}  # collections.defaultdict: keep the items (SETITEMS follow), never call the factory


_REBUILDERS = (_rebuild_tensor_v2, _rebuild_tensor)
_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "double", "float", "half", "long", "int", "short")}
# Everything the unpickler may hand out as a real object: values, containers and our tensor rebuilders.
# Any other global becomes a Stub class, which can be instantiated empty and filled but never called.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): _plain_dict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "dict"): dict,
    ("builtins", "list"): list, ("builtins", "tuple"): tuple, ("builtins", "int"): int,
    ("builtins", "float"): float, ("builtins", "bool"): bool, ("builtins", "complex"): complex,
    ("builtins", "str"): str, ("builtins", "bytes"): bytes, ("builtins", "bytearray"): bytearray,
    ("builtins", "slice"): slice, ("builtins", "range"): range, ("builtins", "object"): object,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("kernels._internals.layer.layer", "_rebuild_kernel_func"): _kernel_func,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
    **{("torch", name): dt for name, dt in _DTYPES.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """`find_class` hands out allow-listed objects, else a per-name `Stub` subclass; imports nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 spellings (protocol 2: `__builtin__.set`)
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        stubs = self.__dict__.setdefault("_stubs", {})
        if (module, name) not in stubs:
            stubs[(module, name)] = _stub_class(module, name)
        return stubs[(module, name)]


def _restricted_load(f, **kwargs) -> Any:
    return _RestrictedUnpickler(f, **kwargs).load()


# torch.load wants a module-like object: it subclasses `.Unpickler` and calls `.load` (legacy format)
_RESTRICTED = types.SimpleNamespace(__name__="rankserve_restricted_pickle", Unpickler=_RestrictedUnpickler,
                                    load=_restricted_load)


def load_torch_pickle(path: str | Path, trust_pickle: bool = False) -> Any:
    """Load a .pt/.bin that may hold whole pickled objects; tensors come back on the CPU.

    Without `trust_pickle` unknown classes become inert `Stub`s and a pickle that calls anything off
    the allow-list raises `CheckpointError` before the call. With it, plain `torch.load(weights_only=False)`.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if trust_pickle:
        return _load_trusted(path)
    if _is_torchscript(path):  # torch.load would hand it to torch.jit.load, which runs the archive's code
        raise CheckpointError(f"{path} is a TorchScript archive, not a pickled model or state dict ({TRUST_HINT})")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED)
    except _NeedsCode as e:
        raise CheckpointError(f"{path}: the pickle calls `{e.args[0]}`, which is not on the allow-list of tensor "
                              f"rebuilders and plain containers; refusing to run code from the file "
                              f"({TRUST_HINT})") from None
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path} is not a readable torch pickle ({_reason(e)})") from None


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.rsplit("/", 1)[-1] == "constants.pkl" for n in z.namelist())
    except zipfile.BadZipFile:  # torch.load will say what is wrong with it
        return False


def stub_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flat state dict (`model.layers.0.self_attn.q_u_proj.weight`) of a pickled module tree.

    Works on `Stub`s and on real `nn.Module`s alike: it reads `_parameters`, `_buffers` and `_modules`
    from each object's `__dict__`. A module reached twice (a shared basis) appears under each path.
    """
    out: dict[str, torch.Tensor] = {}
    _walk(obj, prefix, out, set())
    return out


def _walk(obj: Any, prefix: str, out: dict[str, torch.Tensor], active: set[int]) -> None:
    if id(obj) in active:  # a cycle, not a tree
        return
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return
    active.add(id(obj))
    for kind in ("_parameters", "_buffers"):
        entries = d.get(kind)
        for name, t in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(t, torch.Tensor):
                out[f"{prefix}{name}"] = t
    children = d.get("_modules")
    for name, child in (children.items() if isinstance(children, dict) else ()):
        if child is not None:
            _walk(child, f"{prefix}{name}.", out, active)
    active.discard(id(obj))


def stub_attrs(obj: Any) -> dict[str, Any]:
    """The recorded attributes of a `Stub` (or the `__dict__` of a real object), e.g. a pickled HF config."""
    d = getattr(obj, "__dict__", None)
    return dict(d) if isinstance(d, dict) else {}
