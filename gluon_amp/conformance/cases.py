"""Which ops the harness runs, with which inputs and attributes, and which it leaves out and why.

The candidates are every op a plan can place in a low dtype: the low-precision list, the
conditional ops, and every widest or neutral op (each passes a low dtype on), for either target
dtype (``gluon_amp_core/lists/``, before verdicts). Inputs are generated: an op's declared inputs
get random arrays of a generic shape, tried in a few layouts until FP32 MXNet accepts them;
``SPECS`` gives shapes, value ranges and attributes where an op needs them. An op no layout
fits is reported as not covered, with FP32 MXNet's own message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.table import OpClass, list_classes

from ..mxnet_internals import registry

#: (low, high) of a float input's values; an int input is ("int", high): integers in [0, high)
Range = Tuple[object, float]
POSITIVE: Range = (0.5, 1.5)
SIGNED: Range = (-1.5, 1.5)


@dataclass(frozen=True)
class Case:
    """One way to run an op: input shapes and value ranges, attributes."""

    shapes: Tuple[Tuple[int, ...], ...]
    attrs: Mapping[str, str] = field(default_factory=dict)
    ranges: Tuple[Range, ...] = ()
    #: the op draws random numbers: compared under one seed
    random: bool = False
    #: the outputs that carry values (others: indices, states)
    outputs: Optional[Tuple[int, ...]] = None

    def range_of(self, i: int) -> Range:
        return self.ranges[i] if i < len(self.ranges) else SIGNED


def _c(*shapes: Tuple[int, ...], ranges: Sequence[Range] = (), random: bool = False,
       outputs: Optional[Tuple[int, ...]] = None, **attrs: object) -> Case:
    return Case(tuple(shapes), {k: str(v) for k, v in attrs.items()}, tuple(ranges), random, outputs)


_IMG = (1, 4, 8, 8)
_INT = ("int", 3.0)
_P = POSITIVE

#: op -> the cases it runs (an op's verdict is the worst of its cases)
SPECS: Dict[str, List[Case]] = {
    "Convolution": [_c(_IMG, (4, 4, 3, 3), (4,), kernel=(3, 3), num_filter=4, pad=(1, 1))],
    "Deconvolution": [_c(_IMG, (4, 4, 3, 3), (4,), kernel=(3, 3), num_filter=4, no_bias=False)],
    "_contrib_interleaved_matmul_selfatt_qk": [_c((4, 2, 24), heads=2)],
    "_contrib_interleaved_matmul_selfatt_valatt": [_c((4, 2, 24), (4, 4, 4), heads=2)],
    "_contrib_interleaved_matmul_encdec_qk": [_c((4, 2, 8), (5, 2, 16), heads=2)],
    "_contrib_interleaved_matmul_encdec_valatt": [_c((5, 2, 16), (4, 4, 5), heads=2)],
    "reverse": [_c((2, 3, 4), axis=1)],
    "FullyConnected": [_c((2, 8), (4, 8), (4,), num_hidden=4)],
    "RNN": [_c((3, 2, 4), (160,), (1, 2, 4), (1, 2, 4), state_size=4, num_layers=1, mode="lstm",
               state_outputs=False)],
    "BatchNorm": [_c(_IMG, (4,), (4,), (4,), (4,), ranges=(SIGNED, _P, SIGNED, SIGNED, _P), fix_gamma=False)],
    "_contrib_BatchNormWithReLU": [_c(_IMG, (4,), (4,), (4,), (4,), ranges=(SIGNED, _P, SIGNED, SIGNED, _P),
                                      fix_gamma=False)],
    "BatchNorm_v1": [_c(_IMG, (4,), (4,), (4,), (4,), ranges=(SIGNED, _P, SIGNED, SIGNED, _P), fix_gamma=False)],
    "LayerNorm": [_c((2, 3, 8), (8,), (8,))],
    "InstanceNorm": [_c(_IMG, (4,), (4,))],
    "GroupNorm": [_c(_IMG, (2,), (2,), num_groups=2)],
    "Pooling": [_c(_IMG, kernel=(2, 2), stride=(2, 2), pool_type="max"),
                _c(_IMG, kernel=(2, 2), stride=(2, 2), pool_type="avg"),
                _c(_IMG, kernel=(1, 1), global_pool=True, pool_type="avg")],
    "Pooling_v1": [_c(_IMG, kernel=(2, 2), stride=(2, 2), pool_type="max")],
    "_contrib_AdaptiveAvgPooling2D": [_c((1, 8, 16, 16), ranges=(_P,), output_size=1),
                                      _c((1, 4, 8, 8), ranges=(_P,), output_size=2)],
    "_contrib_BilinearResize2D": [_c(_IMG, height=12, width=12)],
    "UpSampling": [_c(_IMG, scale=2, sample_type="nearest", num_args=1)],
    "Activation": [_c((2, 3, 4), act_type=a) for a in ("relu", "sigmoid", "tanh", "softsign", "softrelu")],
    "LeakyReLU": [_c((2, 3, 4), act_type="leaky", slope=0.1), _c((2, 3, 4), act_type="gelu"),
                  _c((2, 3, 4), act_type="elu"), _c((2, 3, 4), act_type="selu"),
                  _c((2, 3, 4), (3,), act_type="prelu")],
    "Reshape": [_c((2, 3, 4), shape=(0, -1))],
    "reshape_like": [_c((2, 3, 4), (6, 4))],
    "Flatten": [_c((2, 3, 4))],
    "expand_dims": [_c((2, 3), axis=1)],
    "squeeze": [_c((2, 1, 3))],
    "slice": [_c((4, 5), begin=(1, 0), end=(3, 4))],
    "slice_axis": [_c((4, 5), axis=1, begin=1, end=4)],
    "slice_like": [_c((4, 5), (2, 3))],
    "SliceChannel": [_c((2, 6, 4), num_outputs=3, axis=1)],
    "_split_v2": [_c((2, 6, 4), indices=(0, 2), axis=1)],
    "take": [_c((5, 4), (3,), ranges=(SIGNED, ("int", 5.0)))],
    "pick": [_c((3, 4), (3,), ranges=(SIGNED, ("int", 4.0)))],
    "batch_take": [_c((3, 4), (3,), ranges=(SIGNED, ("int", 4.0)))],
    "gather_nd": [_c((4, 5), (1, 3), ranges=(SIGNED, ("int", 4.0)))],
    "Embedding": [_c((2, 3), (10, 4), ranges=(("int", 10.0), SIGNED), input_dim=10, output_dim=4)],
    "one_hot": [_c((3,), ranges=(("int", 4.0),), depth=4)],
    "repeat": [_c((2, 3), repeats=2, axis=1)],
    "tile": [_c((2, 3), reps=(2, 1))],
    "broadcast_to": [_c((1, 3), shape=(4, 3))],
    "broadcast_axis": [_c((1, 3), axis=0, size=4)],
    "broadcast_like": [_c((1, 3), (4, 3))],
    "transpose": [_c((2, 3, 4), axes=(2, 0, 1))],
    "SwapAxis": [_c((2, 3, 4), dim1=0, dim2=2)],
    "Pad": [_c(_IMG, mode="constant", pad_width=(0, 0, 0, 0, 1, 1, 1, 1))],
    "Crop": [_c(_IMG, num_args=1, h_w=(4, 4))],
    "depth_to_space": [_c(_IMG, block_size=2)],
    "space_to_depth": [_c(_IMG, block_size=2)],
    "Concat": [_c((2, 3), (2, 4), num_args=2, dim=1)],
    "stack": [_c((2, 3), (2, 3), num_args=2, axis=0)],
    "add_n": [_c((2, 3), (2, 3), num_args=2)],
    "where": [_c((2, 3), (2, 3), (2, 3), ranges=(("int", 2.0), SIGNED, SIGNED))],
    "dot": [_c((3, 4), (4, 5))],
    "batch_dot": [_c((2, 3, 4), (2, 4, 5))],
    "_contrib_box_iou": [_c((3, 4), (2, 4), ranges=(_P, _P))],
    "SequenceMask": [_c((3, 2, 4), (2,), ranges=(SIGNED, ("int", 3.0)), use_sequence_length=True)],
    "SequenceLast": [_c((3, 2, 4), (2,), ranges=(SIGNED, ("int", 3.0)), use_sequence_length=True)],
    "SequenceReverse": [_c((3, 2, 4), (2,), ranges=(SIGNED, ("int", 3.0)), use_sequence_length=True)],
    "Dropout": [_c((2, 3, 4), p=0.0)],
    "clip": [_c((2, 3), a_min=-0.5, a_max=0.5)],
    "max": [_c((2, 3, 4), axis=1)],
    "min": [_c((2, 3, 4), axis=1)],
    "argmax": [_c((2, 3, 4), axis=1)],
    "argmin": [_c((2, 3, 4), axis=1)],
    "softmax": [_c((2, 3, 4), axis=-1)],
    "log_softmax": [_c((2, 3, 4), axis=-1)],
    "L2Normalization": [_c((2, 3, 4))],
    "LRN": [_c(_IMG, nsize=3)],
    "_sample_normal": [_c((2, 3), (2, 3), ranges=(SIGNED, _P), shape=(2,), random=True)],
    "_sample_uniform": [_c((2, 3), (2, 3), ranges=((0.0, 0.5), (1.0, 1.5)), shape=(2,), random=True)],
    "_sample_gamma": [_c((2, 3), (2, 3), ranges=(_P, _P), shape=(2,), random=True)],
    "_sample_exponential": [_c((2, 3), ranges=(_P,), shape=(2,), random=True)],
    "_sample_poisson": [_c((2, 3), ranges=(_P,), shape=(2,), random=True)],
    "_sample_negative_binomial": [_c((2, 3), (2, 3), ranges=(("int", 4.0), (0.2, 0.8)), shape=(2,), random=True)],
    "_sample_generalized_negative_binomial": [_c((2, 3), (2, 3), ranges=(_P, _P), shape=(2,), random=True)],
    "_sample_multinomial": [_c((2, 3), ranges=(_P,), shape=(2,), random=True)],
    "_random_pdf_normal": [_c((2, 4), (2,), (2,), ranges=(SIGNED, SIGNED, _P))],
    "_random_pdf_uniform": [_c((2, 4), (2,), (2,), ranges=((0.6, 0.9), (0.0, 0.5), (1.0, 1.5)))],
    "_random_pdf_gamma": [_c((2, 4), (2,), (2,), ranges=(_P, _P, _P))],
    "_random_pdf_exponential": [_c((2, 4), (2,), ranges=(_P, _P))],
    "_random_pdf_poisson": [_c((2, 4), (2,), ranges=(("int", 4.0), _P))],
    "_random_pdf_negative_binomial": [_c((2, 4), (2,), (2,), ranges=(("int", 4.0), ("int", 4.0), (0.2, 0.8)))],
    "_random_pdf_generalized_negative_binomial": [_c((2, 4), (2,), (2,), ranges=(("int", 4.0), _P, _P))],
    "_random_pdf_dirichlet": [_c((2, 4, 3), (2, 3), ranges=((0.2, 0.3), _P))],
    "Correlation": [_c(_IMG, _IMG, kernel_size=1, max_displacement=1, stride1=1, stride2=1, pad_size=1)],
    "_contrib_ROIAlign": [_c(_IMG, (2, 5), ranges=(SIGNED, (0.0, 1.0)), pooled_size=(2, 2), spatial_scale=1.0)],
    "ROIPooling": [_c(_IMG, (2, 5), ranges=(SIGNED, (0.0, 1.0)), pooled_size=(2, 2), spatial_scale=1.0)],
    "_contrib_box_nms": [_c((1, 5, 6), ranges=(_P,), outputs=())],
    "_contrib_MultiBoxPrior": [_c(_IMG, sizes=(0.5,))],
    "_contrib_arange_like": [_c((2, 3))],
    "_contrib_round_ste": [_c((2, 3))],
    "_contrib_sign_ste": [_c((2, 3))],
    "_npi_where": [_c((2, 3), (2, 3), (2, 3), ranges=(("int", 2.0), SIGNED, SIGNED))],
    "_np_reshape": [_c((2, 3, 4), newshape=(6, 4))],
    "_npx_reshape": [_c((2, 3, 4), newshape=(-2, -1))],
    "_npi_concatenate": [_c((2, 3), (2, 4), num_args=2, axis=1)],
    "_npi_stack": [_c((2, 3), (2, 3), num_args=2, axis=0)],
    "_npi_hstack": [_c((2, 3), (2, 4), num_args=2)],
    "_npi_vstack": [_c((2, 3), (4, 3), num_args=2)],
    "_npi_dstack": [_c((2, 3), (2, 3), num_args=2)],
    "_npi_column_stack": [_c((3,), (3,), num_args=2)],
    "_npi_broadcast_to": [_c((1, 3), shape=(4, 3))],
    "_np_moveaxis": [_c((2, 3, 4), source=0, destination=2)],
    "_np_roll": [_c((2, 3, 4), shift=1, axis=1)],
    "_npi_rot90": [_c((2, 3, 4), k=1, axes=(0, 1))],
    "_npi_pad": [_c((2, 3), pad_width=((1, 1), (1, 1)), mode="constant")],
    "_np_diag": [_c((3, 3))],
    "_np_diagonal": [_c((3, 3))],
    "_npi_diff": [_c((2, 5))],
    "_npi_insert_scalar": [_c((5,), int_ind=1, val=2.0)],
    "_npi_delete": [_c((5,), int_ind=1)],
    "_npi_tril": [_c((3, 3))],
    "_npi_flip": [_c((2, 3), axis=1)],
    "_npi_dsplit": [_c((2, 3, 4), indices=(0, 2), axis=2)],
    "_npi_hsplit": [_c((2, 4), indices=(0, 2), axis=1)],
}

#: ops left out by rule: (test on the canonical name, why)
_RULES: Tuple[Tuple[str, str], ...] = (
    ("_backward_", "a gradient op: each case's backward pass runs it"),
    ("backward", "a gradient op: each case's backward pass runs it"),
    ("_update", "an optimizer's update: it runs on a trainer's float32 weights, outside any plan"),
    ("_sg_", "a fused oneDNN subgraph: the graph pass keeps fused and quantized ops as in FP32"),
    ("quantiz", "quantized data: the graph pass keeps quantized ops as in FP32"),
    ("_cv", "image decoding from files or bytes"),
)
_NAMED: Mapping[str, str] = {
    "amp_cast": "a cast gluon_amp inserts", "amp_multicast": "a cast gluon_amp inserts",
    "Cast": "a cast: its output dtype is its attribute", "_CachedOp": "a cached graph: its ops are covered one by one",
    "_CachedOpThreadSafe": "a cached graph: its ops are covered one by one",
    "_CrossDeviceCopy": "a copy between devices", "_NoGradient": "a placeholder with no kernel",
    "multi_all_finite": "an optimizer's check of float32 gradients", "multi_sum_sq": "an optimizer's norm of gradients",
    "multi_lars": "an optimizer's update", "reset_arrays": "zeroes arrays in place (gradients)",
    "_contrib_calibrate_entropy": "int8 calibration (histograms)", "_npi_share_memory": "compares memory, no values",
    "_set_value": "writes a scalar in place", "_npi_boolean_mask_assign_scalar": "assigns in place",
    "_npi_boolean_mask_assign_tensor": "assigns in place", "_sample_unique_zipfian": "integer sampling, no float input",
    "_npx_constraint_check": "a boolean check, no float output",
}


def candidates() -> Dict[str, Tuple[str, ...]]:
    """Op -> the low dtypes where its list class lets a plan place it in that dtype (an op the
    lists do not name is neutral)."""
    registered = {i.canonical for i in registry.op_infos().values()}
    out: Dict[str, List[str]] = {}
    for dt in LOW_PRECISION_DTYPES:
        classes = list_classes(dt)
        for op in sorted(registered | set(classes)):
            if classes.get(op, OpClass.NEUTRAL) is not OpClass.FP32:
                out.setdefault(op, []).append(dt)
    return {op: tuple(dts) for op, dts in sorted(out.items())}


def unlisted() -> Tuple[str, ...]:
    """Registered ops neither dtype's lists name (neutral: candidates)."""
    listed = set().union(*(list_classes(dt) for dt in LOW_PRECISION_DTYPES))
    return tuple(sorted({i.canonical for i in registry.op_infos().values()} - listed))


def excluded_by_rule(op: str) -> Optional[str]:
    """Why ``op`` is left out without running it, or None."""
    if op in _NAMED:
        return _NAMED[op]
    for part, why in _RULES:
        if part in op:
            return why
    info = registry.op_infos().get(op)
    if info is None:
        return "not registered in this MXNet"
    if not info.inputs and not info.variadic:
        return "no tensor input: nothing a plan casts (it makes its output in its dtype attribute)"
    return None


def generic_cases(op: str) -> List[Case]:
    """Layouts to try for an op without a spec: every input the same shape, or a data input and
    per-channel vectors; two inputs for a variadic op."""
    info = registry.op_infos()[op]
    random = any(w in op for w in _RANDOM_WORDS)
    if info.variadic:
        attrs = {info.count_attr: "2"} if info.count_attr else {}
        return [Case(((2, 3),) * 2, attrs, random=random)]
    n = len(info.inputs)
    return [Case(((2, 3, 4),) * n, random=random), Case(((2, 3, 4),) + ((3,),) * (n - 1), random=random),
            Case(((6,),) * n, random=random), Case(((2, 3, 4),) * n, ranges=(POSITIVE,) * n, random=random)]


#: op names that draw random numbers: whether they run is compared, not their values
_RANDOM_WORDS = ("random", "sample", "shuffle", "bernoulli", "_npi_normal", "_npi_uniform", "gumbel", "pareto",
                 "rayleigh", "weibull", "logistic", "_npi_exponential", "_npi_gamma", "choice", "multinomial")


def cases_of(op: str) -> Tuple[List[Case], bool]:
    """The cases to run, and whether they come from a spec (a spec's cases all run; generic
    layouts are tried in order until FP32 accepts one)."""
    if op in SPECS:
        return SPECS[op], True
    return generic_cases(op), False


def registry_size() -> int:
    """Canonical op names MXNet registers."""
    return len({i.canonical for i in registry.op_infos().values()})
