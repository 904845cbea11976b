"""The conversion pass on hand-written JSON graphs: no MXNet involved.

``toy_op_types`` stands in for MXNet's type inference: outputs and free (parameter) inputs
take the dtype of the float inputs, which must agree; BatchNorm keeps float32 parameters;
casts produce their ``dtype``; a multicast, with every input known, gives the widest.
"""
from gluon_amp_core.dtypes import FLOAT_DTYPES, widest
from gluon_amp_core.graph_pass import convert_graph, params_read_through_casts, params_stored_low
from gluon_amp_core.policy import Policy

POLICY = Policy.create("bfloat16")
OP_INPUTS = {"FullyConnected": ("data", "weight", "bias"), "softmax": ("data",),
             "elemwise_add": ("lhs", "rhs"), "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var")}


def var(name):
    return {"op": "null", "name": name, "inputs": []}


def node(op, name, *inputs, **attrs):
    return {"op": op, "name": name, "attrs": {k: str(v) for k, v in attrs.items()},
            "inputs": [[i, 0, 0] for i in inputs]}


def graph(nodes, heads):
    return {"nodes": nodes, "arg_nodes": [], "heads": [[h, 0, 0] for h in heads], "attrs": {}}


def toy_op_types(op, attrs, in_dtypes):
    if op == "amp_cast":
        return in_dtypes, (attrs["dtype"],)
    if op == "amp_multicast":
        if any(t is None for t in in_dtypes):
            return None
        return in_dtypes, (widest(in_dtypes),) * len(in_dtypes)
    data = in_dtypes[:1] if op == "BatchNorm" else in_dtypes
    known = {t for t in data if t in FLOAT_DTYPES}
    if len(known) > 1:
        return None
    t = known.pop() if known else None
    if op == "BatchNorm":
        return (t,) + ("float32",) * (len(in_dtypes) - 1), (t,)
    return tuple(d if d is not None else t for d in in_dtypes), (t,)


def run(g, **kw):
    return convert_graph(g, POLICY, ["x"], {}, toy_op_types, OP_INPUTS, **kw)


def two_fc():
    # x -> fc1(w) -> softmax ; x -> fc2(w) ; fc2 + softmax
    return graph([var("x"), var("w"), node("FullyConnected", "fc1", 0, 1, num_hidden=4, no_bias=True),
                  node("softmax", "sm", 2), node("FullyConnected", "fc2", 0, 1, num_hidden=4, no_bias=True),
                  node("elemwise_add", "add", 4, 3)], [5])


def test_one_cast_per_tensor_and_dtype():
    r = run(two_fc())
    casts = [n for n in r.graph["nodes"] if n["op"] == "amp_cast"]
    # x and w once each for both FCs, fc1's output to fp32 for softmax, fc2's for the add
    assert sorted(c["attrs"]["dtype"] for c in casts) == ["bfloat16", "bfloat16", "float32", "float32"]
    assert r.casts_inserted == 4
    assert r.reasons == {"fc1": "low_precision", "sm": "fp32", "fc2": "low_precision", "add": "widest"}
    assert r.dtypes[("add", 0)] == "float32" and r.dtypes[("fc1", 0)] == "bfloat16"


def test_excluded_node_is_float32_and_marked():
    """The reason is kept beside the graph (the result), never in the node's attributes."""
    r = run(two_fc(), excluded=["fc2"])
    fc2 = next(n for n in r.graph["nodes"] if n["name"] == "fc2")
    assert r.reasons["fc2"] == "excluded" and r.dtypes[("fc2", 0)] == "float32"
    assert fc2.get("attrs", {}) == next(n for n in two_fc()["nodes"] if n["name"] == "fc2").get("attrs", {})


def test_the_pass_adds_no_attribute_to_any_node_and_drops_an_older_gluon_amps():
    """A plan is a plain MXNet graph: MXNet hands every node attribute to a Python custom op's
    constructor (``TypeError: __init__() got an unexpected keyword argument '__amp_reason__'``)."""
    g = two_fc()
    g["nodes"][-1] = {**g["nodes"][-1], "attrs": {**g["nodes"][-1].get("attrs", {}), "__amp_reason__": "excluded"}}
    r = run(g)
    before = {n["name"]: n.get("attrs", {}) for n in two_fc()["nodes"]}
    for n in r.graph["nodes"]:
        assert not any(k.startswith("__amp_") for k in n.get("attrs", {})), n
        if n["name"] in before and n["op"] != "null":
            assert n.get("attrs", {}) == before[n["name"]]


def test_cast_optional_params_folds_weight_casts():
    r = run(two_fc(), cast_optional_params=True)
    w = next(n for n in r.graph["nodes"] if n["name"] == "w")
    assert w["attrs"]["__dtype__"] == "12" and r.param_dtypes["w"] == "bfloat16"
    assert r.casts_inserted == 3  # x, fc1->fp32, fc2->fp32
    assert all(n["name"] != "w_amp_cast_bfloat16" for n in r.graph["nodes"])


def test_params_read_through_casts_undoes_cast_optional_params():
    """The graph a fused conversion trains on: what the pass stored low, stored in float32 and
    cast where read; every op reads the dtype it read before (the pass without the option)."""
    stored = run(two_fc(), cast_optional_params=True)
    back = params_read_through_casts(stored.graph, {"w"})
    plain = run(two_fc()).graph
    by_name = {n["name"]: n for n in back["nodes"]}
    assert by_name["w"]["attrs"]["__dtype__"] == "0"
    assert by_name["w_amp_cast_bfloat16"]["attrs"] == {"dtype": "bfloat16"}

    def readers(g):  # op -> the names of the nodes it reads
        return {n["name"]: [g["nodes"][e[0]]["name"] for e in n["inputs"]] for n in g["nodes"]}
    assert readers(back) == readers(plain)
    def heads(g):
        return [g["nodes"][h[0]]["name"] for h in g["heads"]]
    assert heads(back) == heads(plain)
    assert params_read_through_casts(stored.graph, {"x"}) is stored.graph  # nothing stored low: unchanged


def test_low_precision_outputs_come_back_float32():
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True)], [2])
    r = run(g)
    head = r.graph["nodes"][r.graph["heads"][0][0]]
    assert head["op"] == "amp_cast" and head["attrs"]["dtype"] == "float32"
    plain = run(g, float32_outputs=False)
    assert plain.graph["nodes"][plain.graph["heads"][0][0]]["name"] == "fc"


def test_batchnorm_parameters_are_never_cast():
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               var("g"), var("b"), var("m"), var("v"), node("BatchNorm", "bn", 2, 3, 4, 5, 6)], [7])
    r = run(g)
    assert r.dtypes[("bn", 0)] == "bfloat16"  # neutral: runs in what it is given
    bn = next(n for n in r.graph["nodes"] if n["name"] == "bn")
    assert [r.graph["nodes"][i[0]]["name"] for i in bn["inputs"][1:]] == ["g", "b", "m", "v"]


def test_user_casts_are_kept():
    # relu(amp_cast(x, float16)): the user's cast stays, relu (neutral) runs in float16
    g = graph([var("x"), node("amp_cast", "mine", 0, dtype="float16"), node("relu", "r", 1)], [2])
    r = run(g, float32_outputs=False)
    assert [n["name"] for n in r.graph["nodes"]] == ["x", "mine", "r"]
    assert r.dtypes[("r", 0)] == "float16" and r.reasons["mine"] == "cast"


def test_parameters_of_ops_that_follow_their_input_get_its_dtype():
    # fc (bf16) -> LeakyReLU(prelu) with its own slope parameter: the slope is cast to bf16
    # (float16: the bfloat16 table runs prelu in float32, having no bf16 kernel for it)
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               var("slope"), node("LeakyReLU", "prelu", 2, 3, act_type="prelu")], [4])
    r = convert_graph(g, Policy.create("float16"), ["x"], {}, toy_op_types, OP_INPUTS,
                      cast_optional_params=True)
    assert r.dtypes[("prelu", 0)] == "float16"
    assert r.param_dtypes["slope"] == "float16" and r.param_dtypes["w"] == "float16"
    bf = run(g)
    assert bf.dtypes[("prelu", 0)] == "float32" and bf.reasons["prelu"] == "conditional_fp32"


def test_pass_is_driven_by_the_type_rule_it_is_given():
    # an op whose output follows only its first input (slice_like): the rule says so, not the pass
    def first_input_rule(op, attrs, in_dtypes):
        if op == "slice_like":
            return in_dtypes, (in_dtypes[0],)
        return toy_op_types(op, attrs, in_dtypes)
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               node("slice_like", "s", 2, 0)], [3])
    r = convert_graph(g, POLICY, ["x"], {}, first_input_rule, OP_INPUTS, float32_outputs=False)
    assert r.dtypes[("s", 0)] == "bfloat16"


def test_fused_and_quantized_nodes_keep_their_fp32_graph_dtypes():
    # x -> fc (bf16) -> quantize -> fused int8 op -> dequantize -> softmax
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               node("_contrib_quantize_v2", "q", 2), node("_sg_fake_conv", "sg", 3),
               node("_contrib_dequantize", "dq", 4), node("softmax", "sm", 5)], [6])
    fp32 = {("x", 0): "float32", ("w", 0): "float32", ("fc", 0): "float32", ("q", 0): "int8",
            ("sg", 0): "int8", ("dq", 0): "float32", ("sm", 0): "float32"}

    def op_types(op, attrs, in_dtypes):
        assert op in ("FullyConnected", "softmax", "amp_cast"), f"{op} typed outside its graph"
        return toy_op_types(op, attrs, in_dtypes)

    r = convert_graph(g, POLICY, ["x"], {}, op_types, OP_INPUTS, fp32_types=fp32)
    assert r.reasons["q"] == r.reasons["sg"] == r.reasons["dq"] == "kept"
    assert r.dtypes[("fc", 0)] == "bfloat16" and r.dtypes[("sg", 0)] == "int8"
    nodes = r.graph["nodes"]
    q = next(n for n in nodes if n["name"] == "q")
    src = nodes[q["inputs"][0][0]]
    assert src["op"] == "amp_cast" and src["attrs"]["dtype"] == "float32"  # back to what q had


def test_variables_read_only_as_parameters_are_parameters():
    from gluon_amp_core.graph_pass import parameter_only_inputs
    g = graph([var("x"), var("w"), var("y"), var("v"),
               node("FullyConnected", "fc1", 0, 1, num_hidden=4, no_bias=True),
               node("FullyConnected", "fc2", 2, 3, num_hidden=4, no_bias=True),
               node("FullyConnected", "fc3", 3, 1, num_hidden=4, no_bias=True),
               node("elemwise_add", "add", 4, 5)], [7])
    # w: weight of fc1 and fc3; v: weight of fc2 but data of fc3; x, y: data
    assert parameter_only_inputs(g, OP_INPUTS) == {"w"}


def _head_dtypes(r):
    nodes = r.graph["nodes"]
    return [r.dtypes[(nodes[h[0]]["name"], h[1])] for h in r.graph["heads"]]


def test_a_parameter_the_type_rule_requires_low_is_stored_low_without_cast_optional_params():
    # float16: fc -> prelu(slope). The slope's dtype is MXNet's rule (prelu follows its data),
    # not an AMP decision: stored float16 with no cast; fc's weight (AMP's decision) stays float32
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               var("slope"), node("LeakyReLU", "prelu", 2, 3, act_type="prelu")], [4])
    r = convert_graph(g, Policy.create("float16"), ["x"], {}, toy_op_types, OP_INPUTS)
    assert r.param_dtypes == {"w": "float32", "slope": "float16"}
    cast_of = {r.graph["nodes"][n["inputs"][0][0]]["name"] for n in r.graph["nodes"] if n["op"] == "amp_cast"}
    assert "slope" not in cast_of and "w" in cast_of


def test_a_required_parameter_also_read_in_float32_stays_float32_with_a_cast():
    # the slope also feeds a float32 op (softmax): storing it low would round what softmax reads
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               var("slope"), node("LeakyReLU", "prelu", 2, 3, act_type="prelu"), node("softmax", "sm", 3)], [4, 5])
    r = convert_graph(g, Policy.create("float16"), ["x"], {}, toy_op_types, OP_INPUTS)
    assert r.param_dtypes["slope"] == "float32" and r.dtypes[("sm", 0)] == "float32"
    assert any(n["name"] == "slope_amp_cast_float16" for n in r.graph["nodes"])


def _multicast_graph(*extra):
    # x -> fc (bf16); a, b: parameters; m = amp_multicast(a, b); n = amp_multicast(fc, c)
    return graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
                  var("a"), var("b"), node("amp_multicast", "m", 3, 4, num_outputs=2),
                  var("c"), node("amp_multicast", "n", 2, 6, num_outputs=2), *extra], [5, 7])


def test_cast_optional_params_stores_parameters_only_a_multicast_of_parameters_reads():
    r = run(_multicast_graph(), cast_optional_params=True)
    assert r.param_dtypes["a"] == r.param_dtypes["b"] == "bfloat16"
    assert r.dtypes[("m", 0)] == "bfloat16"  # typed with the stored dtypes, before what follows
    # next to an op's output the parameter stays: storing it low would narrow the multicast
    assert r.param_dtypes["c"] == "float32" and r.dtypes[("n", 0)] == "float32"
    assert _head_dtypes(r) == ["float32", "float32"]  # graph outputs come back float32
    assert [n["op"] for n in r.graph["nodes"]].count("amp_multicast") == 2  # the graph's casts stay
    off = run(_multicast_graph())
    assert off.param_dtypes["a"] == off.param_dtypes["b"] == off.param_dtypes["c"] == "float32"


def test_cast_optional_params_stores_a_parameter_cast_low_and_multicast():
    # c is also cast to bfloat16 by the graph: stored low, the multicast with fc runs in bf16
    g = _multicast_graph(node("amp_cast", "mine", 6, dtype="bfloat16"))
    g["heads"].append([8, 0, 0])
    r = run(g, cast_optional_params=True)
    assert r.param_dtypes["c"] == "bfloat16" and r.dtypes[("n", 0)] == "bfloat16"
    assert _head_dtypes(r) == ["float32", "float32", "float32"]
    assert any(n["name"] == "mine" for n in r.graph["nodes"])


def test_cast_optional_params_keeps_a_parameter_read_uncast():
    # a is cast to bfloat16 for one reader and read as it is by softmax: it stays float32
    g = graph([var("x"), var("a"), node("amp_cast", "mine", 1, dtype="bfloat16"), node("softmax", "sm", 1)], [2, 3])
    r = run(g, cast_optional_params=True)
    assert r.param_dtypes["a"] == "float32" and r.dtypes[("sm", 0)] == "float32"


# -- params_stored_low: generated graphs ------------------------------------------------

def _random_graph(rng):
    """Variables (``x`` data, ``p0``.. parameters), each read by casts to bfloat16/float16/
    float32 or directly by ops, some of them grouped convolutions; a head or two, sometimes a
    parameter itself."""
    nodes = [var("x")] + [var(f"p{k}") for k in range(rng.randint(1, 5))]
    values = [0]
    for k in range(1, len(nodes)):
        for _ in range(rng.randint(1, 3)):
            how = rng.choice(["bfloat16", "bfloat16", "float16", "float32", "direct"])
            src = k
            if how != "direct":
                nodes.append(node("amp_cast", f"c{len(nodes)}", k, dtype=how))
                src = len(nodes) - 1
            op = rng.choice(["FullyConnected", "Convolution", "elemwise_add"])
            attrs = {"num_group": rng.choice([1, 1, 2])} if op == "Convolution" else {}
            nodes.append(node(op, f"op{len(nodes)}", values[-1], src, **attrs))
            values.append(len(nodes) - 1)
    heads = [values[-1]] + ([rng.randrange(1, len(nodes))] if rng.random() < 0.3 else [])
    return graph(nodes, heads)


def _list_inputs(g):
    """MXNet's ``list_inputs`` order: variables as a depth-first walk from the heads meets them."""
    seen, order = set(), []

    def visit(j):
        if j in seen:
            return
        seen.add(j)
        for e in g["nodes"][j]["inputs"]:
            visit(e[0])
        if g["nodes"][j]["op"] == "null":
            order.append(g["nodes"][j]["name"])
    for h in g["heads"]:
        visit(h[0])
    return order


def _expected_low(g, names):
    """By the rule itself: a named parameter, not a head, every reader a cast to one low dtype,
    no bfloat16 one read by a grouped convolution."""
    nodes, heads = g["nodes"], {h[0] for h in g["heads"]}
    readers = {j: [k for k, n in enumerate(nodes) if any(e[0] == j for e in n["inputs"])] for j in range(len(nodes))}
    out = {}
    for j, n in enumerate(nodes):
        if n["op"] != "null" or n["name"] not in names or j in heads or not readers[j]:
            continue
        casts = [nodes[r] for r in readers[j]]
        dtypes = {c["attrs"].get("dtype") for c in casts if c["op"] == "amp_cast"}
        if any(c["op"] != "amp_cast" for c in casts) or len(dtypes) != 1 or dtypes - {"bfloat16", "float16"}:
            continue
        grouped = any(nodes[u]["op"] == "Convolution" and nodes[u]["attrs"].get("num_group") != "1"
                      for r in readers[j] for u in readers[r])
        if not (grouped and dtypes == {"bfloat16"}):
            out[n["name"]] = dtypes.pop()
    return out


def test_params_stored_low_on_generated_graphs():
    """Each parameter only casts to one low dtype read is stored in it, its casts gone and
    their readers reading it; nothing else changes: other nodes, the heads' values, and the
    order of the graph's inputs (the CachedOp feeds them by position). Reading the stored
    parameters through casts again gives the graph back."""
    import random
    for seed in range(300):
        rng = random.Random(seed)
        g = _random_graph(rng)
        names = {n["name"] for n in g["nodes"] if n["op"] == "null" and n["name"] != "x" and rng.random() < 0.8}
        out, low = params_stored_low(g, names)
        assert low == _expected_low(g, names), seed
        if not low:
            assert out is g
            continue
        assert _list_inputs(out) == _list_inputs(g), seed
        by_name = {n["name"]: n for n in out["nodes"]}
        for name, dtype in low.items():
            assert by_name[name]["attrs"]["__dtype__"] == {"bfloat16": "12", "float16": "2"}[dtype]
        gone = {n["name"] for n in g["nodes"]} - set(by_name)
        assert all(g["nodes"][[m["name"] for m in g["nodes"]].index(c)]["op"] == "amp_cast" for c in gone)

        def reads(graph_, through):  # op name -> names it reads, a removed cast read as its parameter
            nodes = graph_["nodes"]
            def src(e):
                n = nodes[e[0]]
                return nodes[n["inputs"][0][0]]["name"] if n["name"] in through else n["name"]
            return {n["name"]: [src(e) for e in n["inputs"]] for n in nodes if n["name"] not in through}
        assert reads(out, set()) == reads(g, gone), seed
        def heads(gr, through):
            named = [gr["nodes"][h[0]] for h in gr["heads"]]
            return [gr["nodes"][n["inputs"][0][0]]["name"] if n["name"] in through else n["name"] for n in named]
        assert heads(out, set()) == heads(g, gone)
        back = params_read_through_casts(out, set(low))
        assert {n["name"]: n["op"] for n in back["nodes"] if n["op"] != "amp_cast"} == \
            {n["name"]: n["op"] for n in g["nodes"] if n["op"] != "amp_cast"}
