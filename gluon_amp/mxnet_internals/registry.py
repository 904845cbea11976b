"""MXNet's op registry and its generated op functions (MXNet 1.9.1)."""
from __future__ import annotations

import ctypes
import functools
import sys
import types
from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Tuple

from mxnet.base import _LIB, OpHandle, c_str, check_call, mx_uint, py_str

from .code_swap import _TRAMPOLINE_CODE, _original_code


# -- registry: ctypes calls of the C API (1.9.1: MXListAllOpNames, NNGetOpHandle,
#    MXSymbolGetAtomicSymbolInfo). If their signatures change, op_infos() fails at init.
#    op_of_function reads the op handle MXNet's code generator bakes into each generated
#    function's constants (1.9.1: mxnet/ndarray/register.py, mxnet/symbol/register.py);
#    if that changes, init patches nothing and the patching tests fail.


@dataclass(frozen=True)
class OpInfo:
    """One registered name: its canonical op and declared tensor inputs."""

    name: str
    canonical: str
    inputs: Tuple[str, ...]
    variadic: bool


@functools.lru_cache(maxsize=None)
def op_infos() -> Mapping[str, OpInfo]:
    """Every registered op name (aliases included) -> ``OpInfo``."""
    plist = ctypes.POINTER(ctypes.c_char_p)()
    size = ctypes.c_uint()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    names = [py_str(plist[i]) for i in range(size.value)]
    out: Dict[str, OpInfo] = {}
    for name in names:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        real, desc, key_var = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
        num_args, ret = mx_uint(), ctypes.c_char_p()
        arg_names = ctypes.POINTER(ctypes.c_char_p)()
        arg_types = ctypes.POINTER(ctypes.c_char_p)()
        arg_descs = ctypes.POINTER(ctypes.c_char_p)()
        check_call(_LIB.MXSymbolGetAtomicSymbolInfo(
            handle, ctypes.byref(real), ctypes.byref(desc), ctypes.byref(num_args),
            ctypes.byref(arg_names), ctypes.byref(arg_types), ctypes.byref(arg_descs),
            ctypes.byref(key_var), ctypes.byref(ret)))
        inputs = tuple(py_str(arg_names[i]) for i in range(num_args.value)
                       if py_str(arg_types[i]).split(",")[0].split(" ")[0]
                       in ("NDArray-or-Symbol", "Symbol", "NDArray"))
        out[name] = OpInfo(name, py_str(real.value), inputs, bool(key_var.value))
    return types.MappingProxyType(out)


@functools.lru_cache(maxsize=None)
def aliases() -> Mapping[str, str]:
    """Alias -> canonical op name, for names that are not canonical."""
    return types.MappingProxyType(
        {n: i.canonical for n, i in op_infos().items() if n != i.canonical})


@functools.lru_cache(maxsize=None)
def _handle_to_name() -> Dict[int, str]:
    out = {}
    for name, info in op_infos().items():
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        out[handle.value] = info.canonical
    return out


def op_of_function(fn: object) -> Tuple[str, str] | None:
    """``(canonical op, 'ndarray'|'symbol')`` for an MXNet-generated op function, else None.

    A function redirected by :func:`redirect` is read through its original code."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    code = _original_code.get(fn, code) if code is _TRAMPOLINE_CODE else code
    if "_imperative_invoke" in code.co_names:
        kind = "ndarray"
    elif "_symbol_creator" in code.co_names:
        kind = "symbol"
    else:
        return None
    table = _handle_to_name()
    for const in code.co_consts:
        if isinstance(const, int) and not isinstance(const, bool) and const in table:
            return table[const], kind
    return None


# Namespaces whose op functions AMP patches (``op`` modules included, so ``F.X`` in
# ``hybrid_forward`` is covered). Scanned by prefix so contrib/linalg/random/image/sparse,
# ``_internal`` and the numpy front ends are all found.
_ROOTS = ("mxnet.ndarray", "mxnet.symbol", "mxnet.numpy", "mxnet.numpy_extension")


def op_function_sites() -> Iterator[Tuple[types.ModuleType, str, object, str, str]]:
    """Yield ``(module, attribute, function, op, kind)`` for every op function in scope."""
    import mxnet.ndarray.numpy_extension  # noqa: F401  make sure the np front ends are loaded
    for mod_name, module in sorted(sys.modules.items()):
        if module is None or not any(mod_name == r or mod_name.startswith(r + ".") for r in _ROOTS):
            continue
        for attr, value in list(vars(module).items()):
            if not isinstance(value, types.FunctionType):
                continue
            found = op_of_function(value)
            if found is not None:
                yield module, attr, value, found[0], found[1]
