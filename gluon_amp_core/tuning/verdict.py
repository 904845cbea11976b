"""Whether a graph keeps its AMP plan at all: the whole graph against the same graph in float32. Pure.

Per-op choices (:mod:`gluon_amp_core.tuning.problem`) can only move a plan between its own
ops; a graph whose plan is slower than float32 as a whole (a recurrent net: small matrix
products between elementwise ops, a cast on every edge between them) needs the other
answer: run float32. TensorRT never builds an engine slower than the float32 one it timed;
this is that rule for one graph:

- **Measured** (:class:`Verdict`): the plan (with the tuner's choices) and the graph in
  float32 are timed as whole graphs, casts included. The plan is kept only where it is
  faster; a tie runs float32 (the safe side: never slower).
- **Not measured yet** (a first run, a budget that has not paid for the timing, a graph
  that could not be timed): :func:`unmeasured_runs_fp32`. The machine's speed probe found
  the plan faster on convolutional blocks, where an activation (a value an op computed; not
  a parameter, whose cast is the price of float32 master weights) is cast about once per two
  low-precision ops; a plan that casts activations more than
  :data:`UNMEASURED_MAX_CASTS_PER_LOW_OP` times per low-precision op is unlike what the probe
  timed (small products between elementwise ops that cast on every edge), and runs float32
  until it is measured; so does a plan whose low-precision ops read fewer than
  :data:`UNMEASURED_MIN_ELEMENTS_PER_LOW_OP` elements each on average (the probe's blocks read
  hundreds of thousands: on a tiny product, the low dtype saves less than its casts and
  reorders cost).

  Where the first call's shapes are known, the graph's own figures replace the cast count:
  what the low dtype saves grows with the multiply-adds of its low-precision ops (a GEMM's or
  a convolution's), what its casts cost with the elements they convert. A plan whose
  low-precision ops do fewer than :data:`UNMEASURED_MIN_MACS_PER_CAST_ELEMENT` multiply-adds
  per element its casts convert runs float32: its activations' casts, and under ``init`` its
  weights' too, at :data:`WEIGHT_CAST_SHARE` (each master weight is cast every call); in a
  training graph on AMX, the data of each batch norm that gets a layout guard, at
  :data:`GUARD_CAST_WEIGHT` (MobileNet's, beside every depthwise convolution), and its
  activations' casts at :data:`AMX_TRAINING_ACTIVATION_CAST_SHARE` (AMX's products save more). A
  transformer's GEMMs (a cast or two per product, hundreds of multiply-adds per cast element)
  keep the plan; an LSTM cell's small products (tens) do not, nor do dense layers on a few
  rows (AlexNet's at batch 4: 4 multiply-adds per weight element).

  All of that assumes what the probe found: the target dtype faster on this machine. Where it
  did not find it faster (below the speedup that turns the default on: a ``target_dtype``
  asked for explicitly on such a host, bfloat16 on a VM that hides AMX), no unmeasured plan
  runs low: TensorRT's low precision is a permission, never an order to be slower, and the
  measurement, once the budget pays for it, decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from ..decide import CAST_OPS

Key = Tuple[str, int]
FP32 = "float32"

#: Without a measurement, a plan with more activation casts than this per low-precision op
#: runs float32. bfloat16 training graphs under ``init`` at aeec3b5: SSD-512 (1.5x faster than
#: float32 on Zen 4) 0.52, ResNet-50 0.40; an LSTM net shaped as GluonTS DeepAR (which trained at
#: 0.65x float32's speed) 2.79 (converted: 1.40).
UNMEASURED_MAX_CASTS_PER_LOW_OP = 1.0
#: Without a measurement, a plan whose low-precision ops read fewer elements than this on
#: average (all their inputs, parameters included) runs float32. The probe's smallest item, a
#: 2048 -> 1000 dense layer at batch 16, reads 2.1 million; SSD-512's and ResNet-50's convolutions
#: read tens of thousands to millions; a DeepAR LSTM cell's products (batch 32, 40 units) about 8,000.
UNMEASURED_MIN_ELEMENTS_PER_LOW_OP = 16384
#: Without a measurement, where shapes are known: a plan whose low-precision ops do fewer
#: multiply-adds than this per element its casts convert (activations; under ``init``, weights
#: too, at :data:`WEIGHT_CAST_SHARE`; and the data of batch norms that get a layout guard in
#: the graph that runs: :mod:`gluon_amp_core.layout_guards`) runs float32. A bfloat16
#: GEMM saves about half of float32's time per multiply-add (0.04 ns on one Zen 4 core); a cast
#: costs about 1 ns per element, forward and backward: break-even near 100. BERT-base's
#: training graph (8 x 128 tokens): 485 with its weights counted whole; a DeepAR-like LSTM
#: (batch 32, 40 cells): about 50; AlexNet at batch 4: 28 (docs/speed.md).
UNMEASURED_MIN_MACS_PER_CAST_ELEMENT = 128
#: What a parameter's element counts for in that rule, against an activation's 1, in a graph
#: run under ``init`` (its float32 master weights cast at every call). Fitted between two
#: measured graphs on a 2-core AMX host, and nothing finer: AlexNet's training graph at batch 4
#: (28 multiply-adds per cast element with weights counted whole; its plan ran 0.58x FP32:
#: float32 below 0.22) and BERT-base's encoder run at 1 x 128 tokens (112 counted whole; its
#: plan ran 1.66x FP32: the plan above 0.86). A weight cast is one pass over a tensor
#: oneDNN reorders anyway; a product on many rows saves more per multiply-add on AMX than the
#: constant above assumes.
WEIGHT_CAST_SHARE = 0.5
#: What an element of a batch norm's data that gets a layout guard (:mod:`gluon_amp_core.layout_guards`)
#: counts for in that rule, against a cast's 1: the guard reorders the data and the gradient as a
#: cast converts them, and the batch norm then runs on a plain bfloat16 array, which is slower
#: (MobileNet's: 1.1 ms a forward against 0.14). Fitted on training graphs measured on a 2-core
#: AMX host, and nothing finer (docs/speed.md, "Layout guards counted as casts"): GluonCV's
#: SSD-512 MobileNet 1.0 on VOC at batch 2 (135 multiply-adds per element at 1; its plan ran
#: 0.75x FP32: float32 above 1.07), the same net on COCO at batch 2 (its plan 0.92x FP32:
#: float32 above 1.67) and at batch 8 (its plan 0.95x FP32: float32 above 1.85), against
#: ResNeXt-50 32x4d at batch 4 (its plan 1.73x FP32: the plan below 3.3).
GUARD_CAST_WEIGHT = 2.0
#: What an element an activation's cast converts counts for in that rule in a training graph on
#: an AMX host, against 1 elsewhere: there a bfloat16 product saves more per multiply-add than the
#: line assumes (a 3x3 convolution, 256 channels at 64x64, batch 8, trains in 0.18x float32's time
#: on a 2-core AMX host), and each cast pays for three products (forward, data and weight
#: gradients). Fitted between training graphs measured on that host (docs/speed.md, "Activation
#: casts on AMX"), and nothing finer: CIFAR ResNet-20 at batch 32 (its plan 1.47x FP32: the plan
#: below 0.52) and the vs_peer WaveNet at batch 32 (its plan 1.2x FP32: below 0.75), against a
#: DeepAR-like LSTM at batch 32 (float32 above 0.37; its small products run float32 anyway).
#: A converted graph (forward only: the converted WaveNet's plan ran no faster) counts 1.
AMX_TRAINING_ACTIVATION_CAST_SHARE = 0.4

#: Ops whose multiply-adds are more than one per input element: (data input, weight input).
_GEMMS = ("FullyConnected", "Convolution", "Deconvolution", "batch_dot", "dot", "_linalg_gemm2", "linalg_gemm2")


def op_macs(op: str, attrs: Mapping[str, object], in_shapes: Sequence[Sequence[int]],
            out_shape: Optional[Sequence[int]]) -> int:
    """An op's multiply-adds (forward), from its input shapes (and output shape): a GEMM's or
    a convolution's products; any other op, one per input element."""
    def n(shape: Sequence[int]) -> int:
        total = 1
        for d in shape:
            total *= int(d)
        return total
    if op in _GEMMS and len(in_shapes) >= 2 and in_shapes[1]:
        data, weight = in_shapes[0], in_shapes[1]
        if op == "FullyConnected":
            return n(data) * int(weight[0])
        if op == "Convolution" and out_shape is not None:
            return n(out_shape) * n(weight[1:])
        if op == "Deconvolution":
            return n(data) * n(weight[1:])
        if op not in ("Convolution",):  # products: a (..., M, K) by b (..., K, N)
            transpose_b = str(attrs.get("transpose_b", False)).lower() in ("true", "1")
            return n(data) * int(weight[-2] if transpose_b else weight[-1])
    return sum(n(s) for s in in_shapes)


@dataclass(frozen=True)
class Verdict:
    """A graph's two whole-graph times (ms): as AMP runs it (its tuned plan) and in float32."""

    amp_ms: float
    fp32_ms: float

    @property
    def runs_fp32(self) -> bool:
        """True unless the plan measured faster than float32 (a tie runs float32)."""
        return not self.amp_ms < self.fp32_ms

    @property
    def speedup(self) -> float:
        """float32's time over the plan's (above 1: the plan is faster)."""
        return self.fp32_ms / self.amp_ms if self.amp_ms > 0 else 0.0

    def describe(self, target: str) -> str:
        """e.g. ``runs float32: the whole graph in bfloat16 measured 0.65x float32's speed
        (15.2 ms vs 9.9 ms, casts included)``."""
        figures = f"({self.amp_ms:.1f} ms vs {self.fp32_ms:.1f} ms in float32, casts included)"
        if self.runs_fp32:
            return f"runs float32: the whole graph in {target} measured {self.speedup:.2f}x float32's speed {figures}"
        return f"keeps {target}: the whole graph measured {self.speedup:.2f}x float32's speed {figures}"


def low_op_nodes(nodes: Sequence[dict], dtypes: Mapping[Key, Optional[str]], low: str) -> List[str]:
    """The op nodes (not variables, not casts) whose first output the plan holds in ``low``."""
    return [n["name"] for n in nodes
            if n["op"] != "null" and n["op"] not in CAST_OPS and dtypes.get((n["name"], 0)) == low]


def cast_nodes(nodes: Sequence[dict]) -> int:
    """How many cast nodes (``amp_cast``, ``amp_multicast``) a graph holds."""
    return sum(n["op"] in CAST_OPS for n in nodes)


def activation_casts(nodes: Sequence[dict]) -> int:
    """How many cast nodes cast a value an op computed (not only variables: data, parameters)."""
    return sum(n["op"] in CAST_OPS and any(nodes[e[0]]["op"] != "null" for e in n["inputs"]) for n in nodes)


def casts_per_low_op(casts: int, low_ops: int) -> Optional[float]:
    """Casts per low-precision op; ``None`` for a graph without any (nothing runs low)."""
    return casts / low_ops if low_ops else None


def unmeasured_runs_fp32(casts: int, low_ops: int, elements: Optional[int] = None,
                         intensity: Optional[float] = None, probe_slower: bool = False) -> bool:
    """The rule where no whole-graph measurement decides: True (run float32) when this
    machine's speed probe did not find the target dtype faster (``probe_slower``); else when
    the plan's low-precision ops read fewer than :data:`UNMEASURED_MIN_ELEMENTS_PER_LOW_OP` elements each
    on average (``elements``: their inputs' elements in all; ``None``: shapes unknown, not
    counted); else, with ``intensity`` (their multiply-adds per element the activation casts
    convert, from the graph's shapes; ``None``: unknown), when it is below
    :data:`UNMEASURED_MIN_MACS_PER_CAST_ELEMENT`; without it, when the plan has more than
    :data:`UNMEASURED_MAX_CASTS_PER_LOW_OP` activation casts (``casts``) per low-precision op."""
    ratio = casts_per_low_op(casts, low_ops)
    if ratio is None:
        return False
    if probe_slower:
        return True
    if elements is not None and elements / low_ops < UNMEASURED_MIN_ELEMENTS_PER_LOW_OP:
        return True
    if intensity is not None:
        return intensity < UNMEASURED_MIN_MACS_PER_CAST_ELEMENT
    return ratio > UNMEASURED_MAX_CASTS_PER_LOW_OP


def describe_unmeasured(casts: int, low_ops: int, target: str, why: str, elements: Optional[int] = None,
                        intensity: Optional[float] = None, guards: int = 0, probe_slower: Optional[str] = None,
                        activation_share: float = 1.0) -> str:
    """What the rule did with a graph not measured yet, and why it was not. ``guards``: the
    batch norms whose layout guards ``intensity`` counted as casts; ``probe_slower``: the speed
    probe's verdict in words, where it did not find the target dtype faster;
    ``activation_share``: what ``intensity`` counted an activation's cast element for."""
    ratio = casts_per_low_op(casts, low_ops)
    shown = f"{casts} activation casts for {low_ops} {target} ops" + (f" ({ratio:.2f} per op)" if ratio else "")
    if guards:
        shown += f" and {guards} batch norms whose layout guards reorder their data as a cast would"
    if elements is not None and low_ops:
        shown += f", {elements / low_ops:,.0f} input elements per op"
    if intensity is not None and low_ops:
        shown += f", {intensity:,.0f} multiply-adds per cast element"
        if activation_share != 1:
            shown += f" (an activation's cast counted at {activation_share:g}: a training graph on AMX)"
    if probe_slower and low_ops:
        return (f"runs float32 until measured ({why}): {probe_slower}; a plan runs low unmeasured only where "
                f"the probe measured {target} faster")
    if unmeasured_runs_fp32(casts, low_ops, elements, intensity):
        limits = (f"at least {UNMEASURED_MIN_MACS_PER_CAST_ELEMENT:g} multiply-adds per cast element"
                  if intensity is not None else f"at most {UNMEASURED_MAX_CASTS_PER_LOW_OP:g} cast per op")
        return (f"runs float32 until measured ({why}): its plan has {shown}; a plan runs low unmeasured with "
                f"{limits} and at least {UNMEASURED_MIN_ELEMENTS_PER_LOW_OP:,} elements per op")
    return f"runs the plan until measured against float32 ({why}): {shown}"
