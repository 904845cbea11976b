"""MXNet's JSON form of a graph, built by hand for the core's graph-pass tests."""


def graph(nodes, heads):
    """A graph of ``nodes`` whose outputs are output 0 of the nodes at ``heads``."""
    return {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
            "heads": [[h, 0, 0] for h in heads], "attrs": {"mxnet_version": ["int", 10901]}}


def var(name):
    """A variable (graph input) node."""
    return {"op": "null", "name": name, "inputs": []}
