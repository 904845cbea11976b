"""The op table's input-shape rules (gluon_amp_core.shape_limits): where a low kernel fails at some
shapes, and the graph surgery that runs such an op in float32 (gluon_amp_core.retype.in_float32)."""
import itertools

import pytest

from gluon_amp_core.decide import Reason, decide
from gluon_amp_core.retype import in_float32
from gluon_amp_core.shape_limits import OddChannelsRule, OutputPixelsRule, keeps_fp32, limited_nodes
from gluon_amp_core.table import default_table


CRASH = OutputPixelsRule(frozenset({27, 33, 36, 39, 42, 45, 48}), 1, 1, 32, plain=True)


def _attrs(kernel=(1, 1), stride=(1, 1), pad=(0, 0), layout=None, **more):
    attrs = {"kernel": str(kernel), "stride": str(stride), "pad": str(pad), "num_filter": "64"}
    if layout:
        attrs["layout"] = layout
    return {**attrs, **{k: str(v) for k, v in more.items()}}


@pytest.mark.parametrize("channels", [16, 32, 48, 64, 96, 2048])
def test_output_pixels_rule_is_exactly_its_pixel_counts_and_channels(channels):
    for h, w in itertools.product(range(1, 20), range(1, 20)):
        expected = h * w in CRASH.pixels and channels % 32 == 0
        assert CRASH.applies((2, channels, h, w), _attrs()) is expected, (channels, h, w)
        # channels last: the same map, read from the other axes
        assert CRASH.applies((2, h, w, channels), _attrs(layout="NHWC")) is expected, (channels, h, w)


def test_output_pixels_rule_counts_output_pixels_of_its_kernel_and_stride_only():
    # 16x12 at stride 2 gives 8x6 = 48 pixels, but another stride; 8x6 with a 3x3 kernel is another kernel
    assert not CRASH.applies((1, 64, 16, 12), _attrs(stride=(2, 2)))
    assert OutputPixelsRule(CRASH.pixels, 1, None, 32).applies((1, 64, 16, 12), _attrs(stride=(2, 2)))
    assert OutputPixelsRule(CRASH.pixels, 1, None, 32).applies((1, 64, 8, 6), {"kernel": "(1, 1)"})
    assert CRASH.applies((1, 64, 8, 6), {"kernel": "(1, 1)"})  # MXNet's defaults: stride 1, no pad
    assert OutputPixelsRule(CRASH.pixels, None, None, 32).applies((1, 64, 8, 6), _attrs(kernel=(3, 3), pad=(1, 1)))
    assert not CRASH.applies((1, 64, 8, 6), _attrs(kernel=(3, 3), pad=(1, 1)))
    assert CRASH.applies((1, 64, 10, 8), _attrs(pad=(0, 0), kernel=(1, 1), stride=(1, 1))) is False  # 80
    assert not CRASH.applies(None, _attrs())
    assert not CRASH.applies((1, 64), _attrs())
    assert not CRASH.applies((1, 64, 48), _attrs())  # a 2-d kernel on a 1-d map: not an op MXNet runs


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_output_pixels_rule_counts_pixels_of_a_map_of_any_rank(rank):
    """The AMX scan: Conv1D and Conv3D 1x1 kernels die at the same pixel counts as Conv2D."""
    ones = (1,) * rank
    for px in range(1, 100):
        for spatial in {(px,) + (1,) * (rank - 1), (1,) * (rank - 1) + (px,)}:
            assert CRASH.applies((2, 64) + spatial, _attrs(ones, ones, (0,) * rank)) is (px in CRASH.pixels)
    assert not CRASH.applies((2, 64) + (3,) * rank, _attrs((3,) * rank, ones, ones))  # 3x3: 27 pixels, kept
    if rank == 3:
        assert CRASH.applies((2, 64, 3, 3, 3), _attrs(ones, ones, (0,) * rank))
        assert CRASH.applies((2, 3, 4, 3, 64), _attrs(ones, ones, (0,) * rank, layout="NDHWC"))


@pytest.mark.parametrize("attr, value", [("num_group", 2), ("num_group", 64), ("pad", (1, 1)),
                                         ("dilate", (2, 2)), ("dilate", (1, 2))])
def test_a_plain_rule_leaves_grouped_padded_and_dilated_kernels_low(attr, value):
    """The scan: none of these died at any of the rule's pixel counts; a plain rule skips them."""
    base = {"pad": (0, 0), **{attr: value}}
    shape = (1, 64, 4, 6) if attr == "pad" else (1, 64, 8, 6)  # pad 1 on 4x6: a 6x8 output, 48 pixels
    assert not CRASH.applies(shape, _attrs(**base))
    assert OutputPixelsRule(CRASH.pixels, 1, 1, 32).applies(shape, _attrs(**base))  # not plain: any of them
    ones = {"num_group": 1, "pad": (0, 0), "dilate": (1, 1)}
    assert CRASH.applies((1, 64, 8, 6), _attrs(**ones))  # the same attributes at their defaults


def test_the_bfloat16_table_keeps_those_convolutions_in_float32_and_float16_has_no_rule():
    table = default_table("bfloat16")
    for shape, want in [((4, 64, 8, 6), "float32"), ((4, 64, 7, 7), "bfloat16"), ((4, 48, 8, 6), "bfloat16")]:
        d = decide("Convolution", _attrs(), ["float32", "float32"], table, input_shapes=[shape, None])
        assert d.dtype == want, shape
        assert (d.reason is Reason.NARROW_INPUT) is (want == "float32")
    assert not default_table("float16").narrow_fp32
    assert keeps_fp32(table.narrow_fp32["Convolution"], (1, 64, 6, 8), _attrs())


def _chain():
    """data -> conv_a (bf16) -> relu -> conv_b (bf16, 8x6, the rule's) -> conv_c (bf16) -> head,
    with a converter's elided casts: conv_b and conv_c read low values directly."""
    nodes = [
        {"op": "null", "name": "data", "inputs": []},
        {"op": "amp_cast", "name": "data_amp_cast_bfloat16", "attrs": {"dtype": "bfloat16"}, "inputs": [[0, 0, 0]]},
        {"op": "null", "name": "wa", "inputs": []},
        {"op": "Convolution", "name": "conv_a", "attrs": _attrs(), "inputs": [[1, 0, 0], [2, 0, 0]]},
        {"op": "Activation", "name": "relu", "attrs": {"act_type": "relu"}, "inputs": [[3, 0, 0]]},
        {"op": "null", "name": "wb", "inputs": []},
        {"op": "Convolution", "name": "conv_b", "attrs": _attrs(), "inputs": [[4, 0, 0], [5, 0, 0]]},
        {"op": "null", "name": "wc", "inputs": []},
        {"op": "Convolution", "name": "conv_c", "attrs": _attrs(kernel=(3, 3), pad=(1, 1)),
         "inputs": [[6, 0, 0], [7, 0, 0]]},
    ]
    graph = {"nodes": nodes, "arg_nodes": [0, 2, 5, 7], "heads": [[8, 0, 0]], "attrs": {}}
    dtypes = {("data", 0): "float32", ("data_amp_cast_bfloat16", 0): "bfloat16", ("wa", 0): "bfloat16",
              ("conv_a", 0): "bfloat16", ("relu", 0): "bfloat16", ("wb", 0): "bfloat16",
              ("conv_b", 0): "bfloat16", ("wc", 0): "bfloat16", ("conv_c", 0): "bfloat16"}
    return graph, dtypes


def test_limited_nodes_are_the_low_ones_a_rule_applies_to():
    graph, dtypes = _chain()
    shapes = {("data", 0): (1, 64, 8, 6), ("data_amp_cast_bfloat16", 0): (1, 64, 8, 6),
              ("relu", 0): (1, 64, 8, 6), ("conv_b", 0): (1, 64, 8, 6)}
    rules = default_table("bfloat16").narrow_fp32
    assert limited_nodes(graph["nodes"], dtypes, shapes, rules, "bfloat16") == {"conv_a", "conv_b"}
    # conv_c has a 3x3 kernel; a node computing float32 already is not limited
    assert limited_nodes(graph["nodes"], {**dtypes, ("conv_a", 0): "float32"}, shapes, rules, "bfloat16") == {"conv_b"}
    assert not limited_nodes(graph["nodes"], dtypes, {}, rules, "bfloat16")  # shapes unknown


def test_in_float32_moves_only_the_chosen_node_and_gives_its_readers_their_dtype():
    graph, dtypes = _chain()
    out = in_float32(graph, {"conv_a", "conv_b"}, dtypes)
    nodes = out["nodes"]
    by_name = {n["name"]: n for n in nodes}

    def reads(name):
        return [nodes[e[0]]["name"] for e in by_name[name]["inputs"]]

    # conv_a reads the float32 data behind the plan's cast, and its bfloat16 weight through a cast
    assert reads("conv_a") == ["data", "wa_amp_retyped_float32"]
    # its reader gets bfloat16 again
    assert reads("relu") == ["conv_a_amp_retyped_bfloat16"]
    assert by_name["conv_a_amp_retyped_bfloat16"]["attrs"] == {"dtype": "bfloat16"}
    assert reads("conv_b") == ["relu_amp_retyped_float32", "wb_amp_retyped_float32"]
    assert reads("conv_c") == ["conv_b_amp_retyped_bfloat16", "wc"]  # untouched, fed as before
    assert [nodes[h[0]]["name"] for h in out["heads"]] == ["conv_c"]
    assert "data_amp_cast_bfloat16" not in by_name  # nobody reads the plan's cast any more
    assert sorted(out["arg_nodes"]) == [i for i, n in enumerate(nodes) if n["op"] == "null"]
    assert {n["name"] for n in graph["nodes"]} == {"data", "data_amp_cast_bfloat16", "wa", "conv_a", "relu",
                                                   "wb", "conv_b", "wc", "conv_c"}  # the input is not changed


def test_in_float32_of_a_head_casts_the_head_back_and_keeps_users_casts():
    graph, dtypes = _chain()
    out = in_float32(graph, {"conv_c"}, dtypes, keep={"data_amp_cast_bfloat16"})
    nodes = out["nodes"]
    assert [nodes[h[0]]["name"] for h in out["heads"]] == ["conv_c_amp_retyped_bfloat16"]
    # a user's cast is read from, never around
    out = in_float32(graph, {"conv_a"}, dtypes, keep={"data_amp_cast_bfloat16"})
    conv_a = next(n for n in out["nodes"] if n["name"] == "conv_a")
    assert out["nodes"][conv_a["inputs"][0][0]]["name"] == "data_amp_cast_bfloat16_amp_retyped_float32"


def test_in_float32_following_runs_the_ops_after_it_float32_up_to_the_next_low_op():
    """conv_b (chosen) -> relu (follows) -> add with a low branch (follows) -> conv_c (low):
    the float32 values flow on to conv_c, which gets its bfloat16 back through one cast."""
    graph, dtypes = _chain()
    nodes = graph["nodes"][:7] + [
        {"op": "Activation", "name": "relu2", "attrs": {"act_type": "relu"}, "inputs": [[6, 0, 0]]},
        {"op": "elemwise_add", "name": "add", "inputs": [[7, 0, 0], [4, 0, 0]]},
        {"op": "null", "name": "wc", "inputs": []},
        {"op": "Convolution", "name": "conv_c", "attrs": _attrs(), "inputs": [[8, 0, 0], [9, 0, 0]]},
    ]
    graph = {"nodes": nodes, "arg_nodes": [0, 2, 5, 9], "heads": [[10, 0, 0], [8, 0, 0]], "attrs": {}}
    dtypes = {**dtypes, ("relu2", 0): "bfloat16", ("add", 0): "bfloat16"}
    low_ops = {"Convolution"}
    out = in_float32(graph, {"conv_b"}, dtypes, follows=lambda n: n["op"] not in low_ops)
    by_name = {n["name"]: n for n in out["nodes"]}

    def reads(name):
        return [out["nodes"][e[0]]["name"] for e in by_name[name]["inputs"]]

    assert reads("conv_b") == ["relu_amp_retyped_float32", "wb_amp_retyped_float32"]
    assert reads("relu2") == ["conv_b"]  # follows: float32 straight on
    assert reads("add") == ["relu2", "relu_amp_retyped_float32"]  # its low input read in float32, once
    assert reads("conv_c") == ["add_amp_retyped_bfloat16", "wc"]  # the next low op: its dtype back
    # every graph output as it was: add's (float32 now) cast back too, and only once
    assert [out["nodes"][h[0]]["name"] for h in out["heads"]] == ["conv_c", "add_amp_retyped_bfloat16"]
    assert sum(n["name"] == "add_amp_retyped_bfloat16" for n in out["nodes"]) == 1
    # without following, only conv_b moves
    island = in_float32(graph, {"conv_b"}, dtypes)
    assert [island["nodes"][e[0]]["name"] for e in next(n for n in island["nodes"] if n["name"] == "relu2")
            ["inputs"]] == ["conv_b_amp_retyped_bfloat16"]


def test_odd_channels_rule_is_exactly_odd_counts_below_its_bound_on_ungrouped_ops():
    """The kernel scan's classes: bfloat16's kernel blocks even counts below 16 and multiples of
    16; float32's blocks every count below 16. The rule is where the two differ below 16."""
    rule = OddChannelsRule(16)
    assert rule.ranks == (2, 3)  # images and videos; a sequence's first Conv1D feeds a residual stream
    for c in range(1, 200):
        bf16_blocks = (c < 16 and c % 2 == 0) or c % 16 == 0
        want = c < 16 and not bf16_blocks
        for shape, layout in [((2, c, 9, 9), None), ((2, 9, 9, c), "NHWC"), ((2, c, 40), None),
                              ((1, c, 3, 4, 5), None), ((1, 3, 4, 5, c), "NDHWC")]:
            attrs = _attrs(kernel=(3,) * (len(shape) - 2), layout=layout)
            assert rule.applies(shape, attrs) is (want and len(shape) > 3), (c, shape, layout)
            assert OddChannelsRule(16, (1,)).applies(shape, attrs) is (want and len(shape) == 3), (c, shape)
            assert not rule.applies(shape, {**attrs, "num_group": str(c)}) or c == 1, (c, shape)
    assert not rule.applies(None, _attrs()) and not rule.applies((2, 3), _attrs())


def test_the_bfloat16_table_keeps_a_first_convolution_on_an_images_channels_float32():
    table = default_table("bfloat16")
    d = decide("Convolution", _attrs(kernel=(1,), stride=(1,), pad=(0,)), ["float32", "float32"], table,
               input_shapes=[(32, 1, 512), None])
    assert d.dtype == "bfloat16"  # WaveNet's input Conv1D on 1 channel stays low
    for channels, want in [(3, "float32"), (1, "float32"), (4, "bfloat16"), (64, "bfloat16")]:
        d = decide("Convolution", _attrs(kernel=(7, 7), stride=(2, 2), pad=(3, 3)), ["float32", "float32"], table,
                   input_shapes=[(8, channels, 224, 224), None])
        assert (d.dtype, d.reason is Reason.NARROW_INPUT) == (want, want == "float32"), channels
    d = decide("Convolution", _attrs(), ["float32", "float32"], default_table("float16"),
               input_shapes=[(8, 3, 224, 224), None])
    assert d.dtype == "float16"


def test_channels_from_weights_gives_each_convolutions_data_its_channels_and_nothing_else():
    from gluon_amp_core.shape_limits import channels_from_weights
    nodes = [{"op": "null", "name": "data", "inputs": []},
             {"op": "null", "name": "w0", "inputs": []},
             {"op": "Convolution", "name": "c0", "attrs": {"kernel": "(7, 7)"}, "inputs": [[0, 0, 0], [1, 0, 0]]},
             {"op": "null", "name": "w1", "inputs": []},
             {"op": "Convolution", "name": "c1", "attrs": {"kernel": "(3,)", "num_group": "4"},
              "inputs": [[2, 0, 0], [3, 0, 0]]},
             {"op": "null", "name": "w2", "inputs": []},
             {"op": "Convolution", "name": "c2", "attrs": {"layout": "NHWC"}, "inputs": [[4, 0, 0], [5, 0, 0]]},
             {"op": "FullyConnected", "name": "fc", "inputs": [[4, 0, 0], [5, 0, 0]]}]
    got = channels_from_weights(nodes, {"w0": (64, 3, 7, 7), "w1": (64, 16, 3), "w2": (8, 3, 3, 64)})
    assert got == {("data", 0): (0, 3, 0, 0), ("c0", 0): (0, 64, 0)}
    rule = OddChannelsRule(16)
    assert rule.applies(got[("data", 0)], {}) and not rule.applies(got[("c0", 0)], {})
    # an axis not known (0) is never narrower, nor a map of some pixel count
    for r in default_table("bfloat16").narrow_fp32["Convolution"]:
        if not isinstance(r, OddChannelsRule):
            for shape in [(0, 64, 0, 0), (0, 64, 0), (0, 64, 0, 0, 0)]:
                kernel = str((1,) * (len(shape) - 2))
                assert not r.applies(shape, _attrs(kernel=kernel, stride=kernel, pad=str((0,) * (len(shape) - 2)))), r
