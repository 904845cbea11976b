"""MXNet's op registry and its generated op functions (MXNet 1.9.1)."""
from __future__ import annotations

import ctypes
import functools
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Sequence, Tuple

import numpy as np
from mxnet.base import _LIB, OpHandle, _Null, c_str, check_call, mx_uint, py_str
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from .code_swap import _TRAMPOLINE_CODE, _original_code


# -- registry: ctypes calls of the C API (1.9.1: MXListAllOpNames, NNGetOpHandle,
#    MXSymbolGetAtomicSymbolInfo). If their signatures change, op_infos() fails at init.
#    op_of_function reads the op handle MXNet's code generator bakes into each generated
#    function's constants (1.9.1: mxnet/ndarray/register.py, mxnet/symbol/register.py);
#    if that changes, init patches nothing and the patching tests fail.


_TENSOR_TYPES = ("NDArray-or-Symbol", "Symbol", "NDArray")


@dataclass(frozen=True)
class OpInfo:
    """One registered name: its canonical op, declared tensor inputs and attributes."""

    name: str
    canonical: str
    inputs: Tuple[str, ...]
    variadic: bool
    #: the other declared arguments (the op's attributes), in MXNet's order
    attrs: Tuple[str, ...] = ()
    #: the attribute that counts a variable number of inputs (``num_args``), or ""
    count_attr: str = ""


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
        kinds = [py_str(arg_types[i]).split(",")[0].split(" ")[0] for i in range(num_args.value)]
        inputs = tuple(py_str(arg_names[i]) for i, k in enumerate(kinds) if k in _TENSOR_TYPES)
        attrs = tuple(py_str(arg_names[i]) for i, k in enumerate(kinds)
                      if k not in _TENSOR_TYPES and k.rstrip("[]") not in _TENSOR_TYPES)
        count = py_str(key_var.value) if key_var.value else ""
        out[name] = OpInfo(name, py_str(real.value), inputs, bool(count), attrs, count)
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


# -- how a generated op function takes its arguments (1.9.1: mxnet/ndarray/register.py,
#    mxnet/symbol/register.py). Either ``f(*inputs, **kwargs)`` (an op with a variable
#    number of inputs: attributes by keyword only), or ``f(<inputs>=None, <attrs>=_Null,
#    <options>, **kwargs)``: the declared tensor inputs, then every other declared argument
#    in the op's order, positionally or by keyword; keywords the function does not name are
#    attributes too. An attribute left at ``_Null`` is not passed; any other value is passed
#    as ``str(value)`` (``None`` as ``'None'``), except ``dtype``, passed as
#    ``numpy.dtype(value).name`` (a numpy op leaves ``dtype=None`` out). Symbol functions
#    also merge the ``attr`` dict (node annotations). If this changes, signature_of() refuses
#    the function at init and the calling-convention tests fail.

_OPTIONS = {"ndarray": ("out", "name"), "symbol": ("name", "attr", "out")}
_NP_VERIFIERS = ("_verify_all_np_ndarrays", "_verify_np_symbol")
_TENSORS = (NDArray, Symbol)


@dataclass(frozen=True)
class Signature:
    """How one op function takes its inputs and attributes, so a wrapper sees what MXNet sees.

    Attributes
    ----------
    op : str
        The canonical op.
    kind : {'ndarray', 'symbol'}
    params : tuple of str
        The named parameters in positional order: inputs, attributes, options.
    n_inputs : int
        How many leading ``params`` are tensor inputs (``inputs``).
    variadic : bool
        ``f(*inputs, **kwargs)``: every positional argument is an input.
    attrs : frozenset of str
        The declared attributes.
    np_op : bool
        A numpy-frontend op (``dtype=None`` is left out rather than passed).
    count_attr : str
        A variadic op's attribute counting its inputs, which MXNet sets when the call does
        not (``num_args``); "" when it has none.
    """

    op: str
    kind: str
    params: Tuple[str, ...]
    n_inputs: int
    variadic: bool
    attrs: frozenset
    np_op: bool
    count_attr: str = ""

    @property
    def inputs(self) -> Tuple[str, ...]:
        """The declared tensor inputs, in order (none for a variadic op)."""
        return self.params[: self.n_inputs]

    def input_args(self, args: tuple) -> tuple:
        """The positional arguments that are inputs."""
        return args if self.variadic or len(args) <= self.n_inputs else args[: self.n_inputs]

    def option(self, args: tuple, kwargs: Mapping[str, Any], name: str) -> Any:
        """The value of option ``name`` (``'out'``, ``'name'``, ``'attr'``) in this call, or None."""
        if name in kwargs:
            return kwargs[name]
        if not self.variadic and len(args) > self.n_inputs:
            try:
                k = self.params.index(name)
            except ValueError:
                return None
            return args[k] if k < len(args) else None
        return None

    def rule_attributes(self, args: tuple, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """The call's attributes for a rule that reads a few of them as ``str(value)``
        (:func:`gluon_amp_core.decide.decide`): the keywords themselves where that reads
        what MXNet passes (no attribute by position, no ``dtype`` to normalise, no ``attr``),
        else :meth:`attributes`. Cheap on the common call: it runs on every op call."""
        if (self.variadic or len(args) <= self.n_inputs) and "dtype" not in kwargs and "attr" not in kwargs:
            return kwargs
        return self.attributes(args, kwargs)

    def attributes(self, args: tuple, kwargs: Mapping[str, Any]) -> Dict[str, str]:
        """The attributes MXNet's function passes to the op for this call, as it writes them.

        Inputs given by keyword, the options and ``_Null`` values are not attributes;
        ``dtype`` is normalised as MXNet does; node annotations (``__x__``) are left out.
        """
        out: Dict[str, str] = {}
        if not self.variadic and len(args) > self.n_inputs:
            for name, value in zip(self.params[self.n_inputs:], args[self.n_inputs:]):
                if name in self.attrs:
                    self._put(out, name, value)
                elif name == "attr":
                    self._put_all(out, value)
        n_tensors = 0
        for name, value in kwargs.items():
            if name == "attr" and self.kind == "symbol":
                self._put_all(out, value)
            elif isinstance(value, _TENSORS):
                n_tensors += 1
            elif name not in ("out", "name"):
                self._put(out, name, value)
        if self.count_attr and self.count_attr not in out:
            out[self.count_attr] = str(len(args) + n_tensors)
        return out

    def _put(self, out: Dict[str, str], name: str, value: Any) -> None:
        if value is _Null or name.startswith("__"):
            return
        if name == "dtype" and "dtype" in self.attrs:
            if value is None and self.np_op:
                return
            value = _dtype_name(value)
        out[name] = str(value)

    def _put_all(self, out: Dict[str, str], attr: Any) -> None:
        if isinstance(attr, Mapping):
            for k, v in attr.items():
                self._put(out, k, v)


def _dtype_name(value: Any) -> Any:
    """``dtype`` as MXNet's generated functions pass it (bfloat16 is a structured dtype)."""
    try:
        dt = np.dtype(value)
    except TypeError:
        return value  # MXNet raises when the op runs; the wrapper lets it
    return dt.names[0] if dt.names else dt.name


def signature_of(fn: types.FunctionType) -> Signature:
    """The :class:`Signature` of an MXNet-generated op function (or of a copy of one)."""
    found = op_of_function(fn)
    if found is None:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} is not an MXNet-generated op function")
    op, kind = found
    code = fn.__code__
    code = _original_code.get(fn, code) if code is _TRAMPOLINE_CODE else code
    info = op_infos()[op]
    np_op = any(v in code.co_names for v in _NP_VERIFIERS)
    if code.co_flags & inspect.CO_VARARGS:
        return Signature(op, kind, (), 0, True, frozenset(info.attrs), np_op, info.count_attr)
    params = code.co_varnames[: code.co_argcount]
    options = _OPTIONS[kind]
    n = len(info.inputs)
    if params[:n] != info.inputs or params[n:] != info.attrs + options:
        raise RuntimeError(f"gluon_amp cannot read the arguments of {fn.__module__}.{fn.__name__} ({op}): "
                           f"it takes {params}, MXNet declares inputs {info.inputs} and attributes "
                           f"{info.attrs} (MXNet changed how it generates op functions?)")
    return Signature(op, kind, params, n, False, frozenset(info.attrs), np_op)


# Namespaces whose op functions AMP patches (``op`` modules included, so ``F.X`` in
# ``hybrid_forward`` is covered). Scanned by prefix so contrib/linalg/random/image/sparse,
# ``_internal`` and the numpy front ends are all found.
_ROOTS = ("mxnet.ndarray", "mxnet.symbol", "mxnet.numpy", "mxnet.numpy_extension")


#: Op functions MXNet replaced when it generated its op functions again (``mx.library.load``),
#: as ``op_function_sites`` gave them: no module holds them now, but references taken before
#: the load (``from mxnet.ndarray import FullyConnected``) still call them.
_superseded: List[Tuple[types.ModuleType, str, object, str, str]] = []


def op_function_sites() -> Iterator[Tuple[types.ModuleType, str, object, str, str]]:
    """Yield ``(module, attribute, function, op, kind)`` for every op function in scope, and
    for those an extension library's load superseded (:func:`note_superseded`)."""
    yield from _module_sites()
    yield from list(_superseded)


def _module_sites() -> Iterator[Tuple[types.ModuleType, str, object, str, str]]:
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


def module_op_functions() -> List[Tuple[types.ModuleType, str, object, str, str]]:
    """The op functions the modules hold now (taken before a load, for :func:`note_superseded`)."""
    return list(_module_sites())


def note_superseded(before: Sequence[Tuple[types.ModuleType, str, object, str, str]]) -> None:
    """After MXNet generated its op functions again: remember those of ``before`` that no
    module holds now."""
    now = {id(site[2]) for site in _module_sites()}
    known = {id(site[2]) for site in _superseded}
    for site in before:
        if id(site[2]) not in now and id(site[2]) not in known:
            _superseded.append(site)
            known.add(id(site[2]))
