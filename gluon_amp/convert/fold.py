"""Fold batch norm into convolution weights in float32, ahead of MXNet's oneDNN fusion.

Why: see :mod:`gluon_amp_core.fold`. MXNet 1.9.1's fused convolution
(``src/operator/subgraph/mkldnn/mkldnn_conv.cc``, ``UpdateConvWeightBias``) multiplies
the weights by ``gamma / sqrt(var + eps)`` and stores the product in the weights' dtype,
truncating for bfloat16. Here the product is taken in float64 and stored in float32; the
batch norm left behind has a factor in ``[1, 1 + 2**-22]`` and a bias that bfloat16 holds
exactly, so MXNet's truncating fold of it changes nothing.
"""
from __future__ import annotations

import json
import math
from typing import Dict, Tuple

import numpy as np
import mxnet as mx
from mxnet.symbol import Symbol

from gluon_amp_core.fold import ConvBN, conv_bn_pairs

Params = Dict[str, mx.nd.NDArray]


def _identity(eps: float, fix_gamma: bool) -> Tuple[np.float32, np.float32]:
    """``(gamma, var)`` whose fold factor ``gamma / sqrt(var + eps)`` is 1 or just above it."""
    if fix_gamma:  # gamma is read as 1: push var down until var + eps <= 1
        var = np.float32(1.0 - eps)
        while float(var) + eps > 1.0:
            var = np.nextafter(var, np.float32(0))
        return np.float32(1), var
    root = math.sqrt(1.0 + eps)
    gamma = np.float32(root)
    if float(gamma) < root:
        gamma = np.nextafter(gamma, np.float32(np.inf))
    return gamma, np.float32(1)


def _bf16_exact(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the nearest bfloat16 value (ties to even), kept as float32."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _fold_one(p: ConvBN, args: Params, aux: Params) -> bool:
    ctx = args[p.weight].ctx
    get = lambda d, k: d[k].asnumpy().astype(np.float64)  # noqa: E731
    var, mean = get(aux, p.var), get(aux, p.mean)
    if not (np.isfinite(var).all() and (var + p.eps > 0).all()):
        return False  # an untrained or broken batch norm: leave it to MXNet as it is
    gamma = np.ones_like(var) if p.fix_gamma else get(args, p.gamma)
    alpha = gamma / np.sqrt(var + p.eps)
    weight = get(args, p.weight)
    bias = get(args, p.bias) if p.bias else 0.0
    new_w = weight * alpha.reshape((-1,) + (1,) * (weight.ndim - 1))
    new_b = get(args, p.beta) + alpha * (bias - mean)
    id_gamma, id_var = _identity(p.eps, p.fix_gamma)
    put = lambda a: mx.nd.array(np.asarray(a, np.float32), ctx=ctx)  # noqa: E731
    args[p.weight] = put(new_w)
    if p.bias:
        args[p.bias] = put(np.zeros_like(bias))
    args[p.gamma] = put(np.full(var.shape, id_gamma))
    args[p.beta] = put(_bf16_exact(new_b))
    aux[p.mean] = put(np.zeros_like(mean))
    aux[p.var] = put(np.full(var.shape, id_var))
    return True


def _foldable(p: ConvBN, args: Params, aux: Params) -> bool:
    names = [(args, p.weight), (args, p.gamma), (args, p.beta), (aux, p.mean), (aux, p.var)]
    names += [(args, p.bias)] if p.bias else []
    return all(n in d and d[n].dtype == np.float32 for d, n in names)


def fold_batch_norm(sym: Symbol, arg_params: Params, aux_params: Params) -> Tuple[Params, Params, int]:
    """New ``(arg_params, aux_params, pairs folded)`` with each Convolution->BatchNorm
    pair of ``sym`` folded in float32 (inference: running statistics).

    The graph is unchanged and computes the same function; the caller's dicts and arrays
    are not modified. Pairs whose parameters are missing, not float32, or hold a
    variance that is not finite and above ``-eps`` are left alone.
    """
    args, aux = dict(arg_params), dict(aux_params)
    pairs = [p for p in conv_bn_pairs(json.loads(sym.tojson())) if _foldable(p, args, aux)]
    return args, aux, sum(_fold_one(p, args, aux) for p in pairs)
