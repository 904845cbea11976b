"""layout_guards: batch norms that oneDNN's mixed layouts would slow get a plain input."""
import itertools

import pytest

from gluon_amp_core.layout_guards import GUARD_SUFFIX, batchnorms_at_risk, guard_batchnorm_layouts
from graph_json import graph as _graph

BF16, FP32 = "bfloat16", "float32"


def _block(c_in, c_mid, c_out, reader="relu", dtype=BF16, bn_attrs=None, ndim=4, groups=(1, 1)):
    """x (c_in) -> conv1 (c_mid) -> bn -> reader -> conv2 (c_out); the dtypes and shapes MXNet
    would give (batch 2, 8x8)."""
    nodes = [{"op": "null", "name": "x", "inputs": []},
             {"op": "null", "name": "w1", "inputs": []},
             {"op": "Convolution", "name": "conv1", "attrs": {"num_filter": str(c_mid), "kernel": "(3, 3)",
                                                              **_grouped(groups[0])},
              "inputs": [[0, 0, 0], [1, 0, 0]]},
             {"op": "null", "name": "gamma", "inputs": []},
             {"op": "BatchNorm", "name": "bn", "attrs": dict(bn_attrs or {}), "inputs": [[2, 0, 0], [3, 0, 0]]}]
    if reader == "relu":
        nodes.append({"op": "Activation", "name": "act", "attrs": {"act_type": "relu"}, "inputs": [[4, 0, 0]]})
    elif reader == "add":
        nodes.append({"op": "elemwise_add", "name": "act", "attrs": {}, "inputs": [[4, 0, 0], [2, 0, 0]]})
    else:
        nodes.append({"op": "Pooling", "name": "act", "attrs": {"kernel": "(2, 2)"}, "inputs": [[4, 0, 0]]})
    nodes += [{"op": "null", "name": "w2", "inputs": []},
              {"op": "Convolution", "name": "conv2", "attrs": {"num_filter": str(c_out), "kernel": "(1, 1)",
                                                               **_grouped(groups[1])},
               "inputs": [[5, 0, 0], [6, 0, 0]]}]
    graph = _graph(nodes, [7])
    shape = lambda c: (2, c, 8, 8) if ndim == 4 else (2, c, 8)  # noqa: E731
    shapes = {("x", 0): shape(c_in), ("conv1", 0): shape(c_mid), ("bn", 0): shape(c_mid),
              ("act", 0): shape(c_mid), ("conv2", 0): shape(c_out)}
    dtypes = {(n["name"], 0): (FP32 if n["op"] == "null" else dtype) for n in nodes}
    return graph, dtypes, shapes


def _grouped(groups):
    return {"num_group": str(groups)} if groups != 1 else {}


def _odd(c):
    """A channel count AMX's convolutions do not take in all passes, and not plain either."""
    return c % 32 != 0 and c % 16 == 0


@pytest.mark.parametrize("c_in,c_mid,c_out,reader", list(itertools.product((3, 16, 24, 32, 48, 64), (16, 24, 32, 64),
                                                                       (16, 32, 324), ("relu", "add", "pool"))))
def test_a_batch_norm_gets_a_plain_input_where_a_convolution_next_to_it_has_odd_channels(c_in, c_mid, c_out, reader):
    graph, dtypes, shapes = _block(c_in, c_mid, c_out, reader)
    out, n = guard_batchnorm_layouts(graph, dtypes, shapes, BF16)
    # the producer's channels on either side, the batch norm's own, and a reader's through
    # one-to-one ops (not through a sum: its gradient reaches the blocks after it)
    reads_directly = reader == "relu"  # not through a pooling either: its backward has a layout of its own
    want = _odd(c_in) or _odd(c_mid) or (reads_directly and _odd(c_out))
    assert n == int(want)
    # what the tuner's figure counts (tuning.tuner) is what gets a guard: the batch norm, node 4
    assert batchnorms_at_risk(graph, dtypes, shapes, BF16) == ([4] if want else [])
    names = {x["name"]: x for x in out["nodes"]}
    if not want:
        assert out is graph
        return
    guard = names["bn" + GUARD_SUFFIX]
    assert guard["op"] == "Reshape" and guard["attrs"] == {"shape": "(0, 0, 0, 0)"}
    assert out["nodes"][guard["inputs"][0][0]]["name"] == "conv1"
    assert out["nodes"][names["bn"]["inputs"][0][0]]["name"] == "bn" + GUARD_SUFFIX
    # only the batch norm's data moved: every other input reads what it read
    before = {x["name"]: [graph["nodes"][e[0]]["name"] for e in x["inputs"]] for x in graph["nodes"]}
    after = {x["name"]: [out["nodes"][e[0]]["name"] for e in x["inputs"]] for x in out["nodes"]}
    assert {k: v for k, v in after.items() if k not in ("bn", "bn" + GUARD_SUFFIX)} == \
        {k: v for k, v in before.items() if k != "bn"}
    assert after["bn"][1:] == before["bn"][1:]


@pytest.mark.parametrize("g1,g2,reader", list(itertools.product((1, 2, 32, 64), (1, 4, 64), ("relu", "add"))))
def test_a_batch_norm_next_to_a_grouped_convolution_gets_a_plain_input(g1, g2, reader):
    """Grouped and depthwise convolutions run oneDNN's non-AMX kernels whatever their channel
    counts: GluonCV's mobilenet1.0 (batch 4, 112x112) spent 594 ms a step in the reference
    batch-norm backward between them and AMX's 1x1 convolutions, against FP32's 58 ms step."""
    graph, dtypes, shapes = _block(64, 64, 64, reader, groups=(g1, g2))
    out, n = guard_batchnorm_layouts(graph, dtypes, shapes, BF16)
    assert n == int(g1 > 1 or (reader == "relu" and g2 > 1))
    if n:
        names = {x["name"]: x for x in out["nodes"]}
        assert out["nodes"][names["bn"]["inputs"][0][0]]["name"] == "bn" + GUARD_SUFFIX


@pytest.mark.parametrize("case", ["float32", "channels last", "3-D", "graph input"])
def test_what_gets_no_guard(case):
    if case == "graph input":
        nodes = [{"op": "null", "name": "x", "inputs": []},
                 {"op": "BatchNorm", "name": "bn", "attrs": {}, "inputs": [[0, 0, 0]]}]
        graph = _graph(nodes, [1])
        dtypes, shapes = {("x", 0): BF16, ("bn", 0): BF16}, {("x", 0): (2, 16, 8, 8), ("bn", 0): (2, 16, 8, 8)}
    else:
        graph, dtypes, shapes = _block(16, 16, 16, dtype=FP32 if case == "float32" else BF16,
                                       bn_attrs={"axis": "3"} if case == "channels last" else None,
                                       ndim=3 if case == "3-D" else 4)
    assert guard_batchnorm_layouts(graph, dtypes, shapes, BF16) == (graph, 0)


def test_unknown_shapes_count_only_what_is_known():
    graph, dtypes, shapes = _block(16, 32, 32)
    del shapes[("x", 0)]  # conv1's input channels unknown: conv1 is judged by its num_filter (32)
    assert guard_batchnorm_layouts(graph, dtypes, shapes, BF16) == (graph, 0)
    del shapes[("conv1", 0)]  # the batch norm's own shape unknown: nothing to go on
    graph16, dtypes16, shapes16 = _block(16, 16, 16)
    del shapes16[("conv1", 0)]
    assert guard_batchnorm_layouts(graph16, dtypes16, shapes16, BF16) == (graph16, 0)
