"""Check a typed graph against the op table: every op sees the dtypes ``decide`` asks for."""
import json

from gluon_amp import registry
from gluon_amp.decide import decide
from gluon_amp.dtypes import FLOAT_DTYPES, dtype_name


def node_dtypes(sym, **input_types):
    """{(node index, output index): dtype name} from infer_type over all internals."""
    internals = sym.get_internals()
    _, out_types, _ = internals.infer_type(**input_types)
    assert out_types is not None, "infer_type could not type the whole graph"
    by_name = {n: dtype_name(t) for n, t in zip(internals.list_outputs(), out_types)}
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    out = {}
    for i, node in enumerate(nodes):
        name = node["name"]
        if node["op"] == "null":
            out[(i, 0)] = by_name[name]
            continue
        if name + "_output" in by_name:
            out[(i, 0)] = by_name[name + "_output"]
        k = 0
        while f"{name}_output{k}" in by_name:
            out[(i, k)] = by_name[f"{name}_output{k}"]
            k += 1
    return nodes, out


def check_graph(sym, table, excluded=(), **input_types):
    """Return a list of violations; empty when every op runs as the table says."""
    nodes, types = node_dtypes(sym, **input_types)
    infos = registry.op_infos()
    problems, counts = [], {}
    for i, node in enumerate(nodes):
        op = node["op"]
        if op == "null" or op.startswith("amp_"):
            continue
        in_types = [types.get((e[0], e[1])) for e in node["inputs"]]
        d = decide(op, node.get("attrs", {}), in_types, table, excluded=node["name"] in excluded)
        counts[d.reason] = counts.get(d.reason, 0) + 1
        if d.dtype is None:
            continue
        names = infos[op].inputs if op in infos else ()
        for j, t in enumerate(in_types):
            if j < len(names) and names[j] in d.keep_fp32:
                if t != "float32":
                    problems.append(f"{node['name']} ({op}): kept input {names[j]} is {t}")
                continue
            if t in FLOAT_DTYPES and t != d.dtype:
                problems.append(f"{node['name']} ({op}, {d.reason}): input {j} is {t}, want {d.dtype}")
    return problems, counts
