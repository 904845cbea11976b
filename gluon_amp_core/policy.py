"""The AMP policy: one immutable value holding everything that decides an op's dtype. Pure.

A :class:`Policy` is built once from the user's arguments (``Policy.create``), validated
there, and then passed around whole: to patching, the converters, the graph pass and the
report, so training and deployment cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

from .dtypes import parse_target_dtype
from .table import ConditionalSpec, OpTable, build_table, check_conditional, check_name_list, check_op_lists
from .tuning.schedule import TuneBudget, parse_budget

#: A ``target_dtype`` of ``FLOAT32`` means AMP is off: no useful low precision here.
FLOAT32 = "float32"


@dataclass(frozen=True)
class Policy:
    """Target dtype, op lists and batch-norm rule, validated.

    Attributes
    ----------
    target_dtype : {'float16', 'bfloat16', 'float32'}
        ``'float32'``: mixed precision is off (``reason`` says why); ``table`` is None.
    target_precision_ops, fp32_ops, widest_type_ops : tuple of str or None
        Overrides that replace the default list of their class (``None``: the default).
    conditional_fp32_ops : tuple of (op, attr, values) or None
    keep_batchnorm_fp32 : bool or None
        As in Apex: True forces batch norm to float32, False to the target dtype.
    emulate : bool
        Run the plan emulated: every op in float32, every value real AMP holds in the
        target dtype rounded to it (:mod:`gluon_amp_core.emulate`). Same decisions.
    excluded_sym_names : tuple of str or None
        Op node names kept in float32 (as ``excluded_sym_names`` of the converters).
    tune : bool
        Time each low-precision op of a graph in both dtypes, with its casts, on this
        machine, and keep in float32 those not faster low (:mod:`gluon_amp_core.tuning.problem`).
    tune_budget : TuneBudget or None
        What tuning may spend per process (:mod:`gluon_amp_core.tuning.schedule`); set when
        ``tune`` is, ``None`` otherwise.
    table : OpTable or None
        The op table these settings give, checked against the registry it was built with.
    reason : str or None
        Why the policy is float32, when it is.
    """

    target_dtype: str
    target_precision_ops: Optional[Tuple[str, ...]] = None
    conditional_fp32_ops: Optional[Tuple[ConditionalSpec, ...]] = None
    fp32_ops: Optional[Tuple[str, ...]] = None
    widest_type_ops: Optional[Tuple[str, ...]] = None
    keep_batchnorm_fp32: Optional[bool] = None
    emulate: bool = False
    excluded_sym_names: Optional[Tuple[str, ...]] = None
    tune: bool = False
    tune_budget: Optional[TuneBudget] = None
    table: Optional[OpTable] = field(default=None, compare=False, repr=False)
    reason: Optional[str] = field(default=None, compare=False)

    @property
    def enabled(self) -> bool:
        """True when ops run in a low-precision dtype under this policy."""
        return self.table is not None

    @classmethod
    def create(cls, target_dtype: str, *, target_precision_ops: Optional[Sequence[str]] = None,
               conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
               fp32_ops: Optional[Sequence[str]] = None,
               widest_type_ops: Optional[Sequence[str]] = None,
               keep_batchnorm_fp32: Optional[bool] = None,
               emulate: bool = False,
               excluded_sym_names: Optional[Sequence[str]] = None,
               tune: bool = False,
               tune_budget: Any = None,
               known_ops: Optional[Iterable[str]] = None,
               aliases: Optional[Mapping[str, str]] = None,
               reason: Optional[str] = None) -> "Policy":
        """Validate the arguments and build the policy (and its table).

        ``target_dtype`` is a low-precision dtype (any spelling ``parse_target_dtype``
        takes) or ``'float32'`` for off; ``None`` is resolved by the MXNet layer
        (:func:`gluon_amp.make_policy`), which knows the machine. ``known_ops``/``aliases`` are the registry to check op
        names against. ``tune_budget`` is anything :func:`~gluon_amp_core.tuning.schedule.parse_budget`
        reads (``None``: the default). Raises ``TypeError``/``ValueError`` naming the bad argument.
        """
        lists = dict(
            target_precision_ops=_opt(check_name_list, "target_precision_ops", target_precision_ops),
            conditional_fp32_ops=None if conditional_fp32_ops is None else check_conditional(conditional_fp32_ops),
            fp32_ops=_opt(check_name_list, "fp32_ops", fp32_ops),
            widest_type_ops=_opt(check_name_list, "widest_type_ops", widest_type_ops),
        )
        if keep_batchnorm_fp32 is not None and not isinstance(keep_batchnorm_fp32, bool):
            raise TypeError(f"keep_batchnorm_fp32 must be True, False or None, got {keep_batchnorm_fp32!r}")
        if not isinstance(emulate, bool):
            raise TypeError(f"emulate must be True or False, got {emulate!r}")
        if not isinstance(tune, bool):
            raise TypeError(f"tune must be True or False, got {tune!r}")
        if tune and emulate:
            raise ValueError("tune=True with emulate=True: emulation runs every op in float32, so there is "
                             "no speed to tune; drop one of them (tune on hardware with the target's kernels).")
        budget = parse_budget(tune_budget)  # checked even when unused: a typo is an error either way
        budget = budget if tune else None
        excluded = None if excluded_sym_names is None else _node_names(excluded_sym_names)
        if target_dtype == FLOAT32:
            check_op_lists(**lists, known_ops=known_ops, aliases=aliases)  # as the table would
            return cls(FLOAT32, **lists, keep_batchnorm_fp32=keep_batchnorm_fp32,
                       excluded_sym_names=excluded, reason=reason)
        table = build_table(parse_target_dtype(target_dtype), **lists, keep_batchnorm_fp32=keep_batchnorm_fp32,
                            known_ops=known_ops, aliases=aliases)
        return cls(table.target_dtype, **lists, keep_batchnorm_fp32=keep_batchnorm_fp32, emulate=emulate,
                   excluded_sym_names=excluded, tune=tune, tune_budget=budget, table=table)

    @property
    def excluded(self) -> frozenset:
        """The op node names kept in float32, as a set."""
        return frozenset(self.excluded_sym_names or ())

    def describe(self) -> str:
        """One line for logs and errors."""
        if not self.enabled:
            return f"float32 (mixed precision off: {self.reason or 'no low-precision target'})"
        overrides = [n for n in ("target_precision_ops", "fp32_ops", "conditional_fp32_ops",
                                 "widest_type_ops", "keep_batchnorm_fp32", "excluded_sym_names")
                     if getattr(self, n) is not None]
        return (self.target_dtype + " (emulated in float32)" * self.emulate
                + " (tuned per op by measured speed)" * self.tune
                + (f" with {', '.join(overrides)}" if overrides else ""))


def _opt(check: Any, name: str, value: Any) -> Optional[Tuple[str, ...]]:
    return None if value is None else check(name, value)


def _node_names(value: Any) -> Tuple[str, ...]:
    return tuple(sorted(set(check_name_list("excluded_sym_names", value, "op node names"))))
