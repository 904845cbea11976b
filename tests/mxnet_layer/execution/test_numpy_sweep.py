"""Numpy mode (``npx.set_np()``) through every rebuild gluon_amp makes, as a generated sweep
(issue 47): every layer class in ``mxnet.gluon.nn`` and ``mxnet.gluon.rnn`` (found by
introspection) x its optional-input and deferred-shape variants (``use_bias`` True/False where
the constructor takes it; ``in_units``/``in_channels``/``input_size`` given or left to deferred
initialization; for recurrent layers and cells, the begin state given or not) x hybridized or
not x the AMP modes. Each case must give what plain MXNet gives in numpy mode: the classes and
shapes of everything the block returns (first call under ``autograd.record()``, then one more
call outside it), and its parameters' shapes after deferred initialization; where plain MXNet
raises, the same exception class.

Modes: emulated bfloat16, emulated float16, and native bfloat16 on a simulated native host, on
any CPU; native bfloat16 for real where oneDNN has the kernels (the hardware marker). A layer
class appearing in a new MXNet without a recipe here fails
``test_every_gluon_layer_class_has_a_recipe``.
"""
import functools
import inspect
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon, npx
from mxnet.gluon import nn, rnn

MODULES = {"nn": nn, "rnn": rnn}
#: block classes of those modules that are no layer a user builds: bases for subclassing
NOT_LAYERS = {"nn.Block", "nn.HybridBlock", "rnn.RecurrentCell", "rnn.HybridRecurrentCell",
              "rnn.ModifierCell"}
#: classes 1.9.1 builds from legacy ops only (``F.GroupNorm``, ``F.pad``, the cells'
#: ``F.FullyConnected``), which numpy-mode arrays are refused by: plain MXNet raises, and the
#: sweep checks AMP raises the same
LEGACY_ONLY = {"nn.GroupNorm", "nn.InstanceNorm", "nn.ReflectionPad2D", "rnn.BidirectionalCell",
               "rnn.DropoutCell", "rnn.GRUCell", "rnn.HybridSequentialRNNCell", "rnn.LSTMCell",
               "rnn.RNNCell", "rnn.ResidualCell", "rnn.SequentialRNNCell", "rnn.ZoneoutCell"}
#: constructor arguments that give an input size (left out: Gluon defers the weights' shapes)
IN_SIZE_ARGS = ("in_units", "in_channels", "input_size")
BATCH, STEPS, FEATURES, HIDDEN = 2, 3, 4, 5


@dataclass(frozen=True)
class Recipe:
    """How to build a class and call it. ``make(**options)`` builds it with the variant's
    options; ``shape`` is the input's; ``in_size`` what an input-size argument is given when
    the variant gives one; ``call``: "plain" (``block(x)``), "layer" (a recurrent layer,
    state given or not), "cell" (a step with states and an unroll, begin state given or not);
    ``axes`` adds variant axes the constructor signature does not show (containers)."""

    make: Callable[..., gluon.Block]
    shape: Tuple[int, ...]
    in_size: int = FEATURES
    call: str = "plain"
    axes: Tuple[str, ...] = ()


def _lambda_tanh(x: Any) -> Any:
    return mx.np.tanh(x)


def _seq(cls: type, **o: Any) -> gluon.Block:
    net = cls()
    with net.name_scope():
        net.add(nn.Dense(HIDDEN, flatten=False, **o), nn.Activation("relu"))
    return net


def _symbol_block(use_bias: bool = True) -> gluon.SymbolBlock:
    data = mx.sym.var("data").as_np_ndarray()
    weight = mx.sym.var("fc_weight").as_np_ndarray()
    args = [data, weight] + ([] if not use_bias else [mx.sym.var("fc_bias").as_np_ndarray()])
    out = mx.sym.npx.fully_connected(*args, num_hidden=HIDDEN, no_bias=not use_bias, flatten=False)
    return gluon.SymbolBlock(mx.sym.np.tanh(out), data)


def _cells(cls: type, **o: Any) -> gluon.Block:
    net = cls()
    with net.name_scope():
        net.add(rnn.GRUCell(HIDDEN, **o))
        net.add(rnn.LSTMCell(HIDDEN))
    return net


CONV = {1: (2, FEATURES, 6), 2: (2, FEATURES, 6, 6), 3: (2, FEATURES, 4, 4, 4)}
RECIPES: Dict[str, Recipe] = {
    "nn.Activation": Recipe(lambda **o: nn.Activation("relu", **o), (BATCH, FEATURES)),
    "nn.BatchNorm": Recipe(lambda **o: nn.BatchNorm(**o), CONV[2]),
    "nn.BatchNormReLU": Recipe(lambda **o: nn.BatchNormReLU(**o), CONV[2]),
    "nn.Dense": Recipe(lambda **o: nn.Dense(HIDDEN, flatten=False, **o), (BATCH, STEPS, FEATURES)),
    "nn.Dropout": Recipe(lambda **o: nn.Dropout(0.5, **o), (BATCH, FEATURES)),
    "nn.ELU": Recipe(lambda **o: nn.ELU(**o), (BATCH, FEATURES)),
    "nn.Embedding": Recipe(lambda **o: nn.Embedding(10, HIDDEN, **o), (BATCH, STEPS)),
    "nn.Flatten": Recipe(lambda **o: nn.Flatten(**o), (BATCH, STEPS, FEATURES)),
    "nn.GELU": Recipe(lambda **o: nn.GELU(**o), (BATCH, FEATURES)),
    "nn.GroupNorm": Recipe(lambda **o: nn.GroupNorm(num_groups=2, **o), CONV[2]),
    "nn.HybridLambda": Recipe(lambda **o: nn.HybridLambda(lambda F, x: F.np.tanh(x), **o), (BATCH, FEATURES)),
    "nn.HybridSequential": Recipe(lambda **o: _seq(nn.HybridSequential, **o), (BATCH, STEPS, FEATURES),
                                  axes=("use_bias", "in_units")),
    "nn.InstanceNorm": Recipe(lambda **o: nn.InstanceNorm(**o), (BATCH, FEATURES, 6)),
    "nn.Lambda": Recipe(lambda **o: nn.Lambda(_lambda_tanh, **o), (BATCH, FEATURES)),
    "nn.LayerNorm": Recipe(lambda **o: nn.LayerNorm(**o), (BATCH, STEPS, FEATURES)),
    "nn.LeakyReLU": Recipe(lambda **o: nn.LeakyReLU(0.1, **o), (BATCH, FEATURES)),
    "nn.PReLU": Recipe(lambda **o: nn.PReLU(**o), (BATCH, FEATURES, 6)),
    "nn.ReflectionPad2D": Recipe(lambda **o: nn.ReflectionPad2D(1, **o), CONV[2]),
    "nn.SELU": Recipe(lambda **o: nn.SELU(**o), (BATCH, FEATURES)),
    "nn.Sequential": Recipe(lambda **o: _seq(nn.Sequential, **o), (BATCH, STEPS, FEATURES),
                            axes=("use_bias", "in_units")),
    "nn.Swish": Recipe(lambda **o: nn.Swish(**o), (BATCH, FEATURES)),
    "nn.SymbolBlock": Recipe(lambda **o: _symbol_block(**o), (BATCH, STEPS, FEATURES), axes=("use_bias",)),
    "rnn.GRU": Recipe(lambda **o: rnn.GRU(HIDDEN, **o), (STEPS, BATCH, FEATURES), call="layer"),
    "rnn.LSTM": Recipe(lambda **o: rnn.LSTM(HIDDEN, **o), (STEPS, BATCH, FEATURES), call="layer"),
    "rnn.RNN": Recipe(lambda **o: rnn.RNN(HIDDEN, **o), (STEPS, BATCH, FEATURES), call="layer"),
    "rnn.GRUCell": Recipe(lambda **o: rnn.GRUCell(HIDDEN, **o), (BATCH, STEPS, FEATURES), call="cell"),
    "rnn.LSTMCell": Recipe(lambda **o: rnn.LSTMCell(HIDDEN, **o), (BATCH, STEPS, FEATURES), call="cell"),
    "rnn.RNNCell": Recipe(lambda **o: rnn.RNNCell(HIDDEN, **o), (BATCH, STEPS, FEATURES), call="cell"),
    "rnn.DropoutCell": Recipe(lambda **o: rnn.DropoutCell(0.5, **o), (BATCH, STEPS, FEATURES), call="cell"),
    "rnn.BidirectionalCell": Recipe(
        lambda **o: rnn.BidirectionalCell(rnn.GRUCell(HIDDEN, **o), rnn.GRUCell(HIDDEN)),
        (BATCH, STEPS, FEATURES), call="unroll", axes=("input_size",)),
    "rnn.ResidualCell": Recipe(lambda **o: rnn.ResidualCell(rnn.GRUCell(FEATURES, **o)), (BATCH, STEPS, FEATURES),
                               call="cell", axes=("input_size",)),
    "rnn.ZoneoutCell": Recipe(lambda **o: rnn.ZoneoutCell(rnn.GRUCell(HIDDEN, **o), 0.5, 0.5),
                              (BATCH, STEPS, FEATURES), call="cell", axes=("input_size",)),
    "rnn.HybridSequentialRNNCell": Recipe(lambda **o: _cells(rnn.HybridSequentialRNNCell, **o),
                                          (BATCH, STEPS, FEATURES), call="cell", axes=("input_size",)),
    "rnn.SequentialRNNCell": Recipe(lambda **o: _cells(rnn.SequentialRNNCell, **o),
                                    (BATCH, STEPS, FEATURES), call="cell", axes=("input_size",)),
}


def _conv(cls: type, **o: Any) -> gluon.Block:
    return cls(3, 3, **o)


def _pool(cls: type, **o: Any) -> gluon.Block:
    return cls(**o) if cls.__name__.startswith("Global") else cls(2, **o)


for _d in (1, 2, 3):
    for _name in (f"Conv{_d}D", f"Conv{_d}DTranspose"):
        RECIPES[f"nn.{_name}"] = Recipe(functools.partial(_conv, getattr(nn, _name)), CONV[_d])
    for _name in (f"AvgPool{_d}D", f"MaxPool{_d}D", f"GlobalAvgPool{_d}D", f"GlobalMaxPool{_d}D"):
        RECIPES[f"nn.{_name}"] = Recipe(functools.partial(_pool, getattr(nn, _name)), CONV[_d])


def layer_classes() -> Dict[str, type]:
    """Every Block class ``mxnet.gluon.nn`` and ``mxnet.gluon.rnn`` export, as ``nn.Dense``."""
    return {f"{m}.{name}": c for m, mod in MODULES.items() for name, c in vars(mod).items()
            if not name.startswith("_") and inspect.isclass(c) and issubclass(c, gluon.Block)}


def _axes(name: str) -> Dict[str, tuple]:
    """The variant axes of a class: from its constructor's signature, and its recipe's."""
    recipe = RECIPES[name]
    params = set(inspect.signature(layer_classes()[name].__init__).parameters) | set(recipe.axes)
    axes: Dict[str, tuple] = {}
    if "use_bias" in params:
        axes["use_bias"] = (True, False)
    for arg in IN_SIZE_ARGS:
        if arg in params:
            axes[arg] = ("given", "deferred")
    if recipe.call in ("layer", "cell", "unroll"):
        axes["state"] = ("given", "none")
    return axes


@dataclass(frozen=True)
class Case:
    name: str
    variant: Tuple[Tuple[str, Any], ...]
    hybridize: bool

    @property
    def id(self) -> str:
        v = ",".join(f"{k}={val}" for k, val in self.variant)
        return f"{self.name}({v}){'-hybridized' if self.hybridize else ''}"


def cases() -> List[Case]:
    """The sweep: each class x the product of its axes x hybridized or not."""
    out = []
    for name in sorted(RECIPES):
        axes = _axes(name)
        hybrid = issubclass(layer_classes()[name], gluon.HybridBlock)
        for values in itertools.product(*axes.values()):
            for hybridize in ((False, True) if hybrid else (False,)):
                out.append(Case(name, tuple(zip(axes, values)), hybridize))
    return out


def _form(x: Any) -> Any:
    """What a result is made of: classes and shapes, nested as returned."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_form(v) for v in x))
    return (f"{type(x).__module__}.{type(x).__name__}", tuple(x.shape))


def _run(case: Case) -> Any:
    """The case's block built and called twice (recorded, then not): the forms of its results,
    its parameters' shapes; or the exception class plain numpy-mode MXNet would name."""
    recipe = RECIPES[case.name]
    v = dict(case.variant)
    options: Dict[str, Any] = {k: recipe.in_size for k in IN_SIZE_ARGS if v.get(k) == "given"}
    if "use_bias" in v:
        options["use_bias"] = v["use_bias"]
    try:
        block = recipe.make(**options)
        block.initialize()
        if case.hybridize:
            block.hybridize()
        x = mx.np.ones(recipe.shape)
        results = []
        for recorded in (True, False):
            with autograd.record(recorded):
                results.append(_form(_call(block, recipe, x, v.get("state") == "given")))
        mx.nd.waitall()
        return tuple(results), tuple(p.shape for p in block.collect_params().values())
    except Exception as e:  # noqa: BLE001  compared with what plain MXNet raises
        return ("raises", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")


def _call(block: gluon.Block, recipe: Recipe, x: Any, state: bool) -> Any:
    if recipe.call == "plain":
        return block(x)
    if recipe.call == "layer":
        return block(x, block.begin_state(batch_size=x.shape[1])) if state else block(x)
    begin = block.begin_state(batch_size=x.shape[0]) if state else None
    # steps as a list: 1.9.1's unroll splits a merged input with the legacy split, which numpy
    # mode refuses (plain MXNet too)
    steps = [x[:, t] for t in range(x.shape[1])]
    unrolled = block.unroll(len(steps), steps, begin_state=begin, layout="NTC", merge_outputs=False)
    if recipe.call == "unroll":
        return unrolled
    step = block(x[:, 0], block.begin_state(batch_size=x.shape[0]))  # a step needs its states
    return unrolled, step


@functools.lru_cache(maxsize=None)
def plain_results() -> Dict[Case, Any]:
    """Every case run by plain MXNet in numpy mode (no AMP), once per test session."""
    assert gluon_amp.state.current_policy() is None, "plain MXNet's results must be taken with AMP off"
    npx.set_np()
    try:
        return {c: _run(c) for c in cases()}
    finally:
        npx.reset_np()


def _same(plain: Any, got: Any) -> bool:
    if plain[0] == "raises":  # the same failure: the class (messages may name the AMP graph)
        return got[0] == "raises" and got[1] == plain[1]
    return got == plain


KWARGS = {"emulated-bfloat16": {"target_dtype": "bfloat16", "emulate": True},
          "emulated-float16": {"target_dtype": "float16", "emulate": True},
          "native-simulated": {"target_dtype": "bfloat16"}, "native-real": {"target_dtype": "bfloat16"}}


@pytest.fixture(params=["emulated-bfloat16", "emulated-float16", "native-simulated",
                        pytest.param("native-real", marks=pytest.mark.bf16_kernels)])
def amp_mode(request):
    """The ``init`` arguments of an AMP mode, on any CPU: native bfloat16 runs on a simulated
    native host (``gluon_amp.runtime.simulate_native_bf16``, tests/README.md), and for real
    where this CPU has bfloat16 kernels (the hardware marker skips it elsewhere)."""
    if request.param == "native-simulated":
        with gluon_amp.runtime.simulate_native_bf16():
            yield KWARGS[request.param]
    else:
        yield KWARGS[request.param]


@pytest.fixture(scope="module")
def plain() -> Dict[Case, Any]:
    """Plain MXNet's results, taken before any test's mode (or simulated host) is set up."""
    return plain_results()


def test_every_layer_variant_gives_what_plain_mxnet_gives_in_numpy_mode(plain, amp_mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(**amp_mode)
    npx.set_np()
    try:
        got = {c: _run(c) for c in plain}
    finally:
        npx.reset_np()
    wrong = [f"{c.id}:\n    plain MXNet: {plain[c]}\n    under AMP:   {got[c]}" for c in plain
             if not _same(plain[c], got[c])]
    assert not wrong, f"{len(wrong)} of {len(plain)} cases differ from plain MXNet:\n" + "\n".join(wrong[:15])


def test_every_gluon_layer_class_has_a_recipe():
    """The sweep covers what MXNet exports: a new layer class fails here until it has a recipe."""
    assert set(layer_classes()) - NOT_LAYERS == set(RECIPES)


def test_the_sweep_covers_each_optional_input_and_deferred_shape(plain):
    """Both sides of each axis run in plain MXNet, hybridized and not; the classes plain MXNet
    refuses in numpy mode are the ones 1.9.1 leaves legacy (a recipe mistake would add one)."""
    for axis, values in [("use_bias", (True, False)), ("in_units", ("given", "deferred")),
                         ("in_channels", ("given", "deferred")), ("input_size", ("given", "deferred")),
                         ("state", ("given", "none"))]:
        for value in values:
            ran = [c for c in plain if (axis, value) in c.variant and plain[c][0] != "raises"]
            assert any(c.hybridize for c in ran) and any(not c.hybridize for c in ran), (axis, value)
    assert {c.name for c in plain if plain[c][0] == "raises"} == LEGACY_ONLY


# -- the defects of issue 47 the sweep covers, each on its own --------------------------

@pytest.fixture
def numpy_mode():
    npx.set_np()
    yield
    npx.reset_np()


def _amp(kwargs: Dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(**kwargs)


@pytest.mark.parametrize("layer", ["dense", "conv2d"])
def test_a_hybridized_layer_without_bias_gives_numpy_arrays(numpy_mode, amp_mode, layer):
    """d2l's Transformer: an op built with fewer inputs than it declares is rebuilt with
    casts wired in; the rebuilt op was a legacy Symbol, so the block returned NDArray."""
    _amp(amp_mode)
    net = (nn.Dense(4, flatten=False, use_bias=False) if layer == "dense"
           else nn.Conv2D(4, 3, use_bias=False))
    net.initialize()
    net.hybridize()
    x = mx.np.ones((2, 3, 5) if layer == "dense" else (2, 3, 6, 6))
    y = net(x)
    assert isinstance(y, mx.np.ndarray) and y.shape == ((2, 3, 4) if layer == "dense" else (2, 4, 4, 4))


@pytest.mark.parametrize("cls", [rnn.GRU, rnn.LSTM, rnn.RNN], ids=lambda c: c.__name__)
def test_a_recurrent_layer_runs_deferred_and_hybridized_in_numpy_mode(numpy_mode, amp_mode, cls):
    """d2l's RNNLM: numpy mode's ``npx.rnn`` returns a list of outputs, which the op rebuild
    took for one Symbol ('list' object has no attribute 'get_children')."""
    _recurrent_layers_run(amp_mode, cls)


@pytest.mark.parametrize("cls", [rnn.GRU, rnn.LSTM, rnn.RNN], ids=lambda c: c.__name__)
def test_a_recurrent_layer_runs_in_numpy_mode_under_default_init(numpy_mode, cls):
    """``init()`` with no arguments (the machine's default mode) too."""
    _recurrent_layers_run({}, cls)


def _recurrent_layers_run(kwargs: Dict[str, Any], cls: type) -> None:
    _amp(kwargs)
    deferred = cls(HIDDEN)
    deferred.initialize()
    y = deferred(mx.np.ones((STEPS, BATCH, FEATURES)))
    hybrid = cls(HIDDEN, input_size=FEATURES)
    hybrid.initialize()
    hybrid.hybridize()
    z, states = hybrid(mx.np.ones((STEPS, BATCH, FEATURES)), hybrid.begin_state(batch_size=BATCH))
    assert isinstance(y, mx.np.ndarray) and y.shape == (STEPS, BATCH, HIDDEN)
    assert deferred.l0_i2h_weight.shape[1] == FEATURES
    assert isinstance(z, mx.np.ndarray) and z.shape == (STEPS, BATCH, HIDDEN)
    assert all(isinstance(s, mx.np.ndarray) and s.shape == (1, BATCH, HIDDEN) for s in states)


def test_an_emulated_float16_deconvolution_runs_on_numpy_arrays(numpy_mode):
    """Found by the sweep: imperative Conv*DTranspose under emulated float16 rounds its weight
    as a correction term, computed with legacy ops that numpy mode refuses mx.np arrays."""
    _amp({"target_dtype": "float16", "emulate": True})
    net = nn.Conv2DTranspose(3, 3, in_channels=FEATURES)
    net.initialize()
    x = mx.np.ones(CONV[2])
    with autograd.record():
        y = net(x)
    y.backward()
    assert isinstance(y, mx.np.ndarray) and y.shape == (2, 3, 8, 8)
    assert isinstance(net.weight.grad(), mx.np.ndarray)
    gluon_amp.disable()
    ref = net(x).asnumpy()
    assert abs(y.asnumpy() - ref).max() <= 1e-2 * abs(ref).max()


def test_an_op_rebuilt_with_casts_keeps_its_frontend_and_its_list_of_outputs(numpy_mode):
    """``rebuild_op`` in the form the op function gave: numpy class, list where it was one."""
    from gluon_amp import mxnet_internals as mxi
    data, params, state = (mx.sym.var(n).as_np_ndarray() for n in ("data", "params", "state"))
    outs = mx.sym.npx.rnn(data, params, state, mode="gru", state_size=4, num_layers=1, state_outputs=True)
    assert isinstance(outs, list) and len(outs) == 2
    rebuilt = mxi.rebuild_op(outs, [data, params, state])
    assert isinstance(rebuilt, list) and len(rebuilt) == 2
    assert all(isinstance(o, mxi.NP_SYMBOL) for o in rebuilt)
    legacy = mx.sym.FullyConnected(mx.sym.var("x"), num_hidden=3, no_bias=True)
    again = mxi.rebuild_op(legacy, legacy.get_children())
    assert not isinstance(again, mxi.NP_SYMBOL) and again.list_arguments() == legacy.list_arguments()


class _Float64Operand(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(64, flatten=False, in_units=64)

    def hybrid_forward(self, F, x, w):
        return self.dense(x) * w, x.sum(axis=-1) + w[:, :, 0]


def test_a_hybridized_block_promotes_a_float64_operand_as_plain_mxnet(numpy_mode, amp_mode):
    """The graph form of the test below: the block's plan held an amp_multicast converting the
    dense output to float64, which oneDNN's arrays refuse ("unknown type for MKLDNN :1", at the
    first read); now the other inputs come in float32 and the op promotes. The dense layer is
    excluded (float32, as the speed rule decides a small one natively): a plan with no low op
    runs as it is in every mode, where an emulated copy would resolve the multicast itself."""
    import numpy as onp
    net = _Float64Operand()
    net.initialize(mx.init.Xavier())
    x = mx.np.array(onp.random.default_rng(3).normal(size=(2, 4, 64)).astype(onp.float32))
    w = mx.np.array(onp.full((2, 4, 64), 0.5))
    plain = [o.asnumpy() for o in net(x, w)]
    _amp({**amp_mode, "excluded_sym_names": [net.dense.name + "_fwd"]})
    net.hybridize()
    with autograd.record():
        got = net(x, w)
    got[0].backward()
    for g, p in zip(got, plain):
        assert isinstance(g, mx.np.ndarray) and g.dtype == onp.float64 and g.shape == p.shape
        assert abs(g.asnumpy() - p).max() <= 2e-2 * abs(p).max()
    assert onp.isfinite(net.dense.weight.grad().asnumpy()).all()


def test_a_float64_operand_is_promoted_as_plain_mxnet_promotes_it(numpy_mode, amp_mode):
    """Found with d2l's BERT fed float64 weights: numpy mode's binary ops promote mixed dtypes
    (float32 with float64 gives float64); a widest-type op cast its other inputs to float64
    with amp_cast, which oneDNN refuses ("unknown type for MKLDNN :1") under native init."""
    import numpy as onp
    net = nn.Dense(3, flatten=False)
    net.initialize()
    x = mx.np.ones((2, 4, 5))
    w = mx.np.array(onp.full((2, 4, 3), 0.5))
    assert w.dtype == onp.float64
    plain = [(net(x) * w).asnumpy(), (x.sum(axis=-1) + w[..., 0]).asnumpy()]
    _amp(amp_mode)
    with autograd.record():
        got = [net(x) * w, x.sum(axis=-1) + w[..., 0]]
    got[0].backward()
    for g, p in zip(got, plain):
        assert isinstance(g, mx.np.ndarray) and g.dtype == onp.float64 and g.shape == p.shape
        assert abs(g.asnumpy() - p).max() <= 2e-2 * abs(p).max()
