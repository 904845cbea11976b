"""Check a typed graph against the policy: every op sees the dtypes the walker decides."""
import json

from gluon_amp import mxnet_internals as registry
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.dtypes import FLOAT_DTYPES
from gluon_amp_core.walk import walk


def check_graph(sym, policy, excluded=(), **input_types):
    """Return ``(violations, counts by reason)``; no violations when every op runs as decided.

    ``policy`` is a Policy (what ``init`` returns) or its OpTable."""
    table = getattr(policy, "table", None) or policy
    types = infer_dtypes(sym, {k: v for k, v in input_types.items()})
    assert types is not None, "infer_type could not type the whole graph"
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    infos = registry.op_infos()
    problems, counts = [], {}
    for nd in walk(nodes, table, lambda e: types.get((nodes[e[0]]["name"], e[1])), excluded):
        if nd.reason == "cast":
            continue
        d = nd.decision
        counts[d.reason.value] = counts.get(d.reason.value, 0) + 1
        if d.dtype is None:
            continue
        names = infos[nd.op].inputs if nd.op in infos else ()
        for j, t in enumerate(nd.input_dtypes):
            if j < len(names) and names[j] in d.keep_fp32:
                if t != "float32":
                    problems.append(f"{nd.name} ({nd.op}): kept input {names[j]} is {t}")
                continue
            if t in FLOAT_DTYPES and t != d.dtype:
                problems.append(f"{nd.name} ({nd.op}, {d.reason.value}): input {j} is {t}, want {d.dtype}")
    return problems, counts
