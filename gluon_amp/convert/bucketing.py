"""convert_bucketing_module: every bucket of a Module-API ``BucketingModule`` in mixed precision."""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.module import BucketingModule
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import dtype_name
from gluon_amp_core.table import ConditionalSpec
from .. import mxnet_internals as mxi
from .api import convert_model, convert_symbol

_SymGen = Callable[[Hashable], Tuple[Symbol, Sequence[str], Sequence[str]]]


def _check_module(mod: Any) -> None:
    if not isinstance(mod, BucketingModule):
        raise TypeError("convert_bucketing_module expects a mxnet.module.BucketingModule, "
                        f"got {type(mod).__name__}")
    if not mxi.bucketing_buckets(mod):
        raise ValueError("the BucketingModule has no buckets yet: call mod.bind(...) first.")
    if not mod.params_initialized:
        raise ValueError("the BucketingModule's parameters are not initialized: call "
                         "mod.init_params() (or mod.set_params / fit) before converting it.")


def _merge(into: Dict[str, mx.nd.NDArray], new: Dict[str, mx.nd.NDArray], used: set,
           key: Hashable) -> None:
    """Keep each parameter as converted by a bucket that reads it; buckets must agree."""
    for name in used & set(new):
        if name in into and into[name].dtype != new[name].dtype:
            raise RuntimeError(
                f"bucket {key!r} stores parameter {name!r} as {dtype_name(new[name].dtype)} but "
                f"another bucket as {dtype_name(into[name].dtype)}; the buckets share parameters, "
                "so convert with cast_optional_params=False.")
        into.setdefault(name, new[name])


def _converting_sym_gen(sym_gen: _SymGen, param_names: set, options: Dict[str, Any]) -> _SymGen:
    """``sym_gen`` whose symbols come back converted; cached per bucket key."""
    cache: Dict[Hashable, Tuple[Symbol, Sequence[str], Sequence[str]]] = {}

    def converted_sym_gen(bucket_key: Hashable):
        if bucket_key not in cache:
            sym, data_names, label_names = sym_gen(bucket_key)
            inputs = [n for n in sym.list_inputs() if n not in param_names]
            cache[bucket_key] = (convert_symbol(sym, data_names=inputs, **options), data_names,
                                 label_names)
        return cache[bucket_key]

    return converted_sym_gen


def convert_bucketing_module(bucketing_mod: BucketingModule, target_dtype: Any = None,
                             target_dtype_ops: Optional[Sequence[str]] = None,
                             fp32_ops: Optional[Sequence[str]] = None,
                             conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
                             excluded_sym_names: Optional[Sequence[str]] = None,
                             cast_optional_params: bool = False, *,
                             widest_type_ops: Optional[Sequence[str]] = None,
                             keep_batchnorm_fp32: Optional[bool] = None,
                             emulate: Optional[bool] = None) -> BucketingModule:
    """Return a new, unbound ``BucketingModule`` running every bucket in mixed precision.

    Parameters
    ----------
    bucketing_mod : mxnet.module.BucketingModule
        Bound, with initialized parameters. It is not modified.
    target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops, excluded_sym_names,
    cast_optional_params, widest_type_ops, keep_batchnorm_fp32, emulate :
        As for :func:`gluon_amp.convert_model`; applied to every bucket.

    Notes
    -----
    Every bucket the module has created is converted with :func:`convert_model`. Buckets
    created later (a new bucket key at ``switch_bucket``/``forward``) are converted too:
    the new module's ``sym_gen`` wraps the original one.
    """
    _check_module(bucketing_mod)
    options = dict(target_dtype=target_dtype, target_dtype_ops=target_dtype_ops, fp32_ops=fp32_ops,
                   conditional_fp32_ops=conditional_fp32_ops, excluded_sym_names=excluded_sym_names,
                   cast_optional_params=cast_optional_params, widest_type_ops=widest_type_ops,
                   keep_batchnorm_fp32=keep_batchnorm_fp32, emulate=emulate)
    arg_params, aux_params = bucketing_mod.get_params()  # synced from the executors
    new_args: Dict[str, mx.nd.NDArray] = {}
    new_aux: Dict[str, mx.nd.NDArray] = {}
    sym_dict = {}
    for key, module in mxi.bucketing_buckets(bucketing_mod).items():
        sym = module.symbol
        sym_dict[key], args, aux = convert_model(sym, arg_params, aux_params, **options)
        _merge(new_args, args, set(sym.list_arguments()), key)
        _merge(new_aux, aux, set(sym.list_auxiliary_states()), key)
    for src, dst in ((arg_params, new_args), (aux_params, new_aux)):
        for name, value in src.items():  # read by no converted bucket: keep as is
            dst.setdefault(name, value.copy())
    opts = mxi.bucketing_module_options(bucketing_mod)
    sym_gen = _converting_sym_gen(opts.pop("sym_gen"), set(arg_params) | set(aux_params), options)
    return BucketingModule.load_dict(sym_dict, sym_gen=sym_gen, arg_params=new_args, aux_params=new_aux,
                                     logger=bucketing_mod.logger, **opts)
