"""Generate a golden reference of PyTorch GradScaler's loss-scale trajectory.

Run with a Python that has torch installed, e.g.::

    /tmp/torchenv/bin/python tools/gen_gradscaler_golden.py

Output: ``tests/core/data/gradscaler_trajectory.json`` (relative to the repository
root; the path is resolved from this file's location, so the working
directory does not matter).

The tests read this JSON file and never import torch (torch conflicts with
gluoncv in the test environment). Re-run this script only to regenerate the
reference.

Each scenario drives a real ``torch.amp.GradScaler("cpu", ...)`` with a single
parameter tensor ``p`` and an SGD optimizer. Per step::

    optimizer.zero_grad()
    loss = (p * 1.0).sum()
    scaler.scale(loss).backward()
    if step is non-finite: p.grad[0] = inf (or nan, per scenario)
    scaler.step(optimizer)
    scaler.update()

and records ``scaler.get_scale()`` after ``update()``, the growth tracker
after ``update()`` and whether the optimizer step was skipped (detected by
comparing ``p`` before/after the step). The final ``scaler.state_dict()`` is
stored as plain JSON types.

JSON layout::

    {"torch_version": str,
     "scenarios": [{"name", "init_scale", "growth_factor", "backoff_factor",
                    "growth_interval", "nonfinite_value" ("inf"/"nan"/null),
                    "steps" [bool: True = finite grads],
                    "scales_after_update" [float],
                    "growth_tracker_after_update" [int],
                    "skipped" [bool],
                    "state_dict" {...}}]}
"""

import json
import math
import os

import torch

OUT_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "tests", "core", "data", "gradscaler_trajectory.json")


def _plain(v):
    """Convert torch/numpy scalars and tensors to plain JSON types."""
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if hasattr(v, "item"):
        return _plain(v.item())
    raise TypeError("cannot convert %r" % (v,))


def run_scenario(name, steps, init_scale, growth_factor, backoff_factor,
                 growth_interval, nonfinite_value):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=0.01)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=growth_factor,
        backoff_factor=backoff_factor, growth_interval=growth_interval)
    bad = {"inf": math.inf, "nan": math.nan}.get(nonfinite_value)

    scales, trackers, skipped = [], [], []
    for finite in steps:
        opt.zero_grad()
        loss = (p * 1.0).sum()
        scaler.scale(loss).backward()
        if not finite:
            with torch.no_grad():
                p.grad[0] = bad
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(torch.equal(before, p.detach())))
        scales.append(float(scaler.get_scale()))
        trackers.append(int(scaler.state_dict()["_growth_tracker"]))

    return {
        "name": name,
        "init_scale": float(init_scale),
        "growth_factor": float(growth_factor),
        "backoff_factor": float(backoff_factor),
        "growth_interval": int(growth_interval),
        "nonfinite_value": nonfinite_value,
        "steps": [bool(s) for s in steps],
        "scales_after_update": scales,
        "growth_tracker_after_update": trackers,
        "skipped": skipped,
        "state_dict": _plain(scaler.state_dict()),
    }


def scenarios():
    out = []
    # a. defaults: 2 non-finite, 4005 finite (grows twice), 1 non-finite.
    out.append(dict(name="a_defaults", init_scale=2.0 ** 16,
                    growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2000, nonfinite_value="inf",
                    steps=[False] * 2 + [True] * 4005 + [False]))
    # b. small interval, irregular non-finite pattern.
    bad_b = {0, 5, 6, 13, 20, 21, 22}
    out.append(dict(name="b_interval3_pattern", init_scale=8.0,
                    growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=3, nonfinite_value="nan",
                    steps=[i not in bad_b for i in range(40)]))
    # c. 3 finite, 1 non-finite, repeated; 30 steps.
    out.append(dict(name="c_growth4_backoff025_alternating",
                    init_scale=1024.0, growth_factor=4.0,
                    backoff_factor=0.25, growth_interval=2,
                    nonfinite_value="inf",
                    steps=[(i % 4) != 3 for i in range(30)]))
    # d. tiny scale, all non-finite: scale keeps shrinking (no clamp in torch).
    out.append(dict(name="d_tiny_all_nonfinite", init_scale=2.0 ** -10,
                    growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=1, nonfinite_value="nan",
                    steps=[False] * 20))
    # e. grows every step (torch has no max_scale).
    out.append(dict(name="e_grow_every_step", init_scale=65536.0,
                    growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=1, nonfinite_value=None,
                    steps=[True] * 30))
    return out


def _dump(obj):
    """JSON with one key per line but each list kept on a single line."""
    lines = ["{", '  "torch_version": %s,' % json.dumps(obj["torch_version"]),
             '  "scenarios": [']
    scs = obj["scenarios"]
    for i, sc in enumerate(scs):
        lines.append("    {")
        items = list(sc.items())
        for j, (k, v) in enumerate(items):
            sep = "," if j < len(items) - 1 else ""
            lines.append("      %s: %s%s" % (
                json.dumps(k), json.dumps(v, separators=(",", ":"),
                                          allow_nan=False), sep))
        lines.append("    }" + ("," if i < len(scs) - 1 else ""))
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def main():
    result = {"torch_version": torch.__version__,
              "scenarios": [run_scenario(**kw) for kw in scenarios()]}
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    text = _dump(result)
    json.loads(text)  # sanity: valid JSON
    with open(OUT_PATH, "w") as f:
        f.write(text)
    print("wrote %s (%d bytes)" % (OUT_PATH, len(text)))
    for sc in result["scenarios"]:
        s = sc["scales_after_update"]
        print("%-36s n=%d skips=%d first=%s last=%s state=%s" % (
            sc["name"], len(s), sum(sc["skipped"]), s[:4], s[-4:],
            sc["state_dict"]))


if __name__ == "__main__":
    main()
