"""Render ``docs/op_reference.md`` from the op tables.

Regenerate with ``python -m gluon_amp_core.op_reference > docs/op_reference.md``; a test
checks the committed file is current.
"""
from __future__ import annotations

from typing import List

from .dtypes import LOW_PRECISION_DTYPES
from .table import OpClass, OpTable, default_table, split_key
from .verdicts import Verdict

_RULES = """\
# gluon_amp op reference

Generated from `gluon_amp_core/lists/` (verdicts included) by `python -m gluon_amp_core.op_reference`.
Do not edit by hand.

## How an op's precision is chosen

Under `gluon_amp.init(target_dtype)`, every MXNet operator belongs to exactly one class.
The same rule (`gluon_amp_core.decide.decide`) drives imperative calls, hybridized graphs and
the inference converter.

| class | what happens to the op's floating-point inputs |
|---|---|
| low precision | cast to the target dtype (`float16` or `bfloat16`) |
| fp32 | cast to `float32` |
| conditional fp32 | cast to `float32` when an attribute takes a listed value, else neutral |
| widest | cast to the widest float type among the inputs (`float16` + `bfloat16` widen to `float32`) |
| neutral | left as they are; the op runs in whatever dtype it is given |

- A few low-precision ops run in float32 at input shapes where their kernel is known to
  be wrong (listed per dtype below), decided from the input shapes of each call (a
  hybridized block's graph is rebuilt when new shapes keep more ops in float32).
- Integer, boolean and float64 inputs are never cast (MXNet's `amp_cast` passes them
  through): float64 values run as they are, as with MXNet's own AMP.
- Every way of calling an op that MXNet's function accepts works the same: inputs and
  attributes positional or by keyword, `name=`, and `out=`, which gets the result in the
  dtype of the caller's array (cast there when the op ran in another).
- Normalisation parameters and running statistics (listed under *kept inputs*) stay
  `float32` whatever the class.
- Aliases (`concat`, `_PlusScalar`, `_npx_convolution`, ...) take the class of the op
  they name; the lists below give registered op names only.
- Ops with no tensor inputs (creation and sampling ops such as `_arange`, `_zeros`) are
  neutral: there is nothing to cast.
- Override any list with the matching `init` argument; an override *replaces* the default
  list of its class, and an op may be in one list only.
- The classes below include the conformance verdicts (`gluon_amp_core/lists/verdicts.py`, measured
  by `python -m gluon_amp.conformance`; every op, dtype and host in [op_conformance.md](op_conformance.md)):
  an op with no kernel in the target dtype, or a kernel beyond its error bound, runs in float32;
  an op that refuses mixed float inputs runs in the widest. An op you name in a list keeps your class.
"""


def _names(names) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "(none)"


def render_table(t: OpTable) -> List[str]:
    out = [f"## target dtype `{t.target_dtype}`", ""]
    titles = {
        OpClass.LOW_PRECISION: f"Ops that run in {t.target_dtype}",
        OpClass.FP32: "Ops that run in float32",
        OpClass.CONDITIONAL_FP32: "Ops that run in float32 for some attribute values",
        OpClass.WIDEST: "Ops that run in the widest input type",
        OpClass.NEUTRAL: "Neutral ops",
    }
    for cls, title in titles.items():
        names = t.names(cls)
        out += [f"### {title} ({len(names)})", ""]
        if cls is OpClass.CONDITIONAL_FP32:
            out += [f"- `{n}` when `{t.conditions[n].attr}` in "
                    f"{sorted(t.conditions[n].values)}" for n in names]
        else:
            out.append(_names(names))
        out.append("")
    out += ["### Low-precision ops kept in float32 for some input shapes", ""]
    out += [f"- `{op}` when {rule.describe()}"
            for op, rules in sorted(t.narrow_fp32.items()) for rule in rules] or ["(none)"]
    out.append("")
    out += ["### Widest ops kept in float32 with more inputs than their kernel takes", ""]
    out += [f"- `{op}` with more than {n} inputs" for op, n in sorted(t.fp32_above_inputs.items())] or ["(none)"]
    out.append("")
    out += ["### Slow ops run as a fast twin where their inputs have one shape", ""]
    out += [f"- `{op}` as `{twin}`" + (f" ({', '.join(f'{k}={v}' for k, v in attrs)})" if attrs else "")
            for op, (twin, attrs) in sorted(t.same_shape_twins.items())] or ["(none)"]
    out.append("")
    out += ["### Classes set by a conformance verdict", ""]
    out += [_verdict_line(t, key, v) for key, v in sorted(t.verdicts.items())] or ["(none)"]
    out.append("")
    out += ["### Kept float32 inputs", ""]
    out += [f"- `{op}`: {_names(sorted(v))}" for op, v in sorted(t.keep_fp32_inputs.items())]
    out.append("")
    return out


def _verdict_line(t: OpTable, key: str, v: Verdict) -> str:
    op, cond = split_key(key)
    if cond is not None:
        return f"- `{op}` when `{cond[0]}` is `{cond[1]}`: {v.value} -> float32"
    return f"- `{op}`: {v.value} -> {t.classes[op].value}"


def render() -> str:
    lines = [_RULES]
    for dt in LOW_PRECISION_DTYPES:
        lines += render_table(default_table(dt))
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
