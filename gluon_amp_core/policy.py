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
        (:func:`gluon_amp.make_policy`), which knows the machine. ``known_ops``/``aliases`` are the registry
        to check op names against. ``tune_budget`` is anything :func:`~gluon_amp_core.tuning.schedule.parse_budget`
        reads (``None``: the default). Raises ``TypeError``/``ValueError`` naming the bad argument.
        """
        off = target_dtype == FLOAT32
        spec = PolicySpec.parse(None if off else target_dtype, target_precision_ops=target_precision_ops,
                                conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops,
                                widest_type_ops=widest_type_ops, keep_batchnorm_fp32=keep_batchnorm_fp32,
                                emulate=emulate, excluded_sym_names=excluded_sym_names, tune=tune,
                                tune_budget=tune_budget, strict_flags=True)
        return cls.from_spec(spec, FLOAT32 if off else spec.requested, tune=tune, known_ops=known_ops,
                             aliases=aliases, reason=reason)

    @classmethod
    def from_spec(cls, spec: "PolicySpec", target_dtype: Optional[str], *, tune: bool,
                  known_ops: Optional[Iterable[str]] = None, aliases: Optional[Mapping[str, str]] = None,
                  reason: Optional[str] = None) -> "Policy":
        """The policy of parsed arguments, trusted as they are: ``target_dtype`` is the
        resolved dtype (``'float32'``: off), ``tune`` what ``spec.tune`` means here. Only the op
        names are checked, against the registry (``known_ops``/``aliases``), which the spec
        does not know."""
        lists = dict(target_precision_ops=spec.target_precision_ops, conditional_fp32_ops=spec.conditional_fp32_ops,
                     fp32_ops=spec.fp32_ops, widest_type_ops=spec.widest_type_ops)
        if target_dtype == FLOAT32 or target_dtype is None:
            check_op_lists(**lists, known_ops=known_ops, aliases=aliases)  # as the table would
            return cls(FLOAT32, **lists, keep_batchnorm_fp32=spec.keep_batchnorm_fp32,
                       excluded_sym_names=spec.excluded_sym_names, reason=reason)
        table = build_table(target_dtype, **lists, keep_batchnorm_fp32=spec.keep_batchnorm_fp32,
                            known_ops=known_ops, aliases=aliases)
        return cls(table.target_dtype, **lists, keep_batchnorm_fp32=spec.keep_batchnorm_fp32,
                   emulate=bool(spec.emulate), excluded_sym_names=spec.excluded_sym_names, tune=tune,
                   tune_budget=spec.tune_budget if tune else None, table=table)

    @property
    def excluded(self) -> frozenset:
        """The op node names kept in float32, as a set."""
        return frozenset(self.excluded_sym_names or ())

    def describe(self) -> str:
        """One line for logs and errors."""
        if not self.enabled:
            return f"float32 (mixed precision off: {self.reason or 'no low-precision target'})"
        overrides = [n for n in ("target_precision_ops", "fp32_ops", "conditional_fp32_ops",
                                 "widest_type_ops", "excluded_sym_names") if getattr(self, n) is not None]
        if self.keep_batchnorm_fp32 is not None:  # a flag: its value is the setting
            overrides.insert(4, f"keep_batchnorm_fp32={self.keep_batchnorm_fp32}")
        return (self.target_dtype + " (emulated in float32)" * self.emulate
                + " (tuned per op by measured speed)" * self.tune
                + (f" with {', '.join(overrides)}" if overrides else ""))


@dataclass(frozen=True)
class PolicySpec:
    """Every argument of a policy, each parsed once (:meth:`parse`, the one validation at the
    edge); what is built from it (:meth:`Policy.from_spec`, the MXNet layer's resolution of
    ``requested``) trusts it.

    Attributes
    ----------
    requested : {'float16', 'bfloat16'} or None
        The target dtype asked for, parsed; ``None``: the machine picks.
    emulate, tune : bool or None
        As given (``None``: the caller's default).
    tune_budget : TuneBudget
        Parsed, defaulted.
    """

    requested: Optional[str]
    target_precision_ops: Optional[Tuple[str, ...]] = None
    conditional_fp32_ops: Optional[Tuple[ConditionalSpec, ...]] = None
    fp32_ops: Optional[Tuple[str, ...]] = None
    widest_type_ops: Optional[Tuple[str, ...]] = None
    keep_batchnorm_fp32: Optional[bool] = None
    emulate: Optional[bool] = None
    excluded_sym_names: Optional[Tuple[str, ...]] = None
    tune: Optional[bool] = None
    tune_budget: Optional[TuneBudget] = None

    @classmethod
    def parse(cls, target_dtype: Any = None, *, target_precision_ops: Any = None, conditional_fp32_ops: Any = None,
              fp32_ops: Any = None, widest_type_ops: Any = None, keep_batchnorm_fp32: Any = None,
              emulate: Any = None, excluded_sym_names: Any = None, tune: Any = None, tune_budget: Any = None,
              strict_flags: bool = False) -> "PolicySpec":
        """Parse and check every argument once. ``strict_flags``: ``emulate``/``tune`` must be
        bools (``Policy.create``), else ``None`` is allowed too (``make_policy``: its default).
        Raises ``TypeError``/``ValueError`` naming the bad argument and what is allowed."""
        allowed = (True, False) if strict_flags else (None, True, False)
        choices = "True or False" if strict_flags else "True, False or None"
        for name, value in (("emulate", emulate), ("tune", tune), ("keep_batchnorm_fp32", keep_batchnorm_fp32)):
            if name == "keep_batchnorm_fp32":
                if value is not None and not isinstance(value, bool):
                    raise TypeError(f"keep_batchnorm_fp32 must be True, False or None, got {value!r}")
            elif not any(value is a for a in allowed):
                raise TypeError(f"{name} must be {choices}, got {value!r}")
        if tune and emulate:
            raise ValueError("tune=True with emulate=True: emulation runs every op in float32, so there is "
                             "no speed to tune; drop one of them (tune on hardware with the target's kernels).")
        return cls(
            requested=None if target_dtype is None else parse_target_dtype(target_dtype),
            target_precision_ops=_opt(check_name_list, "target_precision_ops", target_precision_ops),
            conditional_fp32_ops=None if conditional_fp32_ops is None else check_conditional(conditional_fp32_ops),
            fp32_ops=_opt(check_name_list, "fp32_ops", fp32_ops),
            widest_type_ops=_opt(check_name_list, "widest_type_ops", widest_type_ops),
            keep_batchnorm_fp32=keep_batchnorm_fp32, emulate=emulate, tune=tune,
            tune_budget=parse_budget(tune_budget),  # checked even when unused: a typo is an error either way
            excluded_sym_names=None if excluded_sym_names is None else _node_names(excluded_sym_names))


def _opt(check: Any, name: str, value: Any) -> Optional[Tuple[str, ...]]:
    return None if value is None else check(name, value)


def _node_names(value: Any) -> Tuple[str, ...]:
    return tuple(sorted(set(check_name_list("excluded_sym_names", value, "op node names"))))
