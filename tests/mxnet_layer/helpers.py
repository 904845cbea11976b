"""What the MXNet-layer tests share: small networks and data, graph checks, and the
environment of a host without bfloat16 kernels. Import it as ``from helpers import ...``."""
import contextlib
import hashlib
import json
import os

import numpy as np
import mxnet as mx
from mxnet import gluon
from mxnet.gluon import nn

from gluon_amp import mxnet_internals as mxi
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.dtypes import FLOAT_DTYPES
from gluon_amp_core.walk import walk

#: tests/mxnet_layer: its data/ and dist/ folders, and this module, which a test's fresh
#: process (run from its own subfolder) finds by putting LAYER on its PYTHONPATH.
LAYER = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(LAYER))


class MixedNet(nn.HybridBlock):
    """conv -> BN -> relu -> dense -> softmax, plus a residual add of a low-precision
    branch and a float32 branch (softmax output)."""

    def __init__(self, channels=8, classes=10, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv = nn.Conv2D(channels, 3, padding=1)
            self.bn = nn.BatchNorm()
            self.side = nn.Conv2D(channels, 1)
            self.dense = nn.Dense(classes)

    def hybrid_forward(self, F, x):
        low = F.relu(self.bn(self.conv(x)))
        fp32 = F.softmax(self.side(x), axis=1)
        mixed = low + fp32
        return F.softmax(self.dense(mixed))


def bf16_train_step(net, x):
    """One recorded forward and backward of ``net`` under ``gluon_amp.init('bfloat16')``,
    hybridized again so that its graph is built with AMP on; its output."""
    import gluon_amp
    gluon_amp.init(target_dtype="bfloat16")
    net.hybridize()
    with mx.autograd.record():
        y = net(x)
    y.backward()
    return y


def make_net(seed=0, hybridize=True):
    mx.random.seed(seed)
    net = MixedNet()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    return net


def internal_types(sym, **input_types):
    """{output name: dtype name} for every node of ``sym``."""
    from gluon_amp_core.dtypes import dtype_name
    internals = sym.get_internals()
    _, out_types, _ = internals.infer_type(**input_types)
    return {n: dtype_name(t) for n, t in zip(internals.list_outputs(), out_types)}


def blobs(n=512, seed=0):
    """Two classes of 8x8 images: a bright blob top-left vs bottom-right, plus noise."""
    # (seeded) of 8x8 images: a bright blob top-left vs bottom-right, plus noise
    rng = np.random.RandomState(seed)
    x = rng.normal(0, 1, size=(n, 1, 8, 8)).astype("float32")
    y = rng.randint(0, 2, size=n)
    for i in range(n):
        r = slice(0, 4) if y[i] == 0 else slice(4, 8)
        x[i, 0, r, r] += 1.0
    return mx.nd.array(x), mx.nd.array(y)




def cnn(seed=0, hybridize=True, prefixed=False):
    """conv -> BN -> relu -> max-pool -> dense on 1x8x8 inputs (two classes). ``prefixed``
    names the layers conv0_, bn_, dense0_ without a block prefix."""
    mx.random.seed(seed)
    net = nn.HybridSequential(prefix="") if prefixed else nn.HybridSequential()
    kw = (lambda p: {"prefix": p}) if prefixed else (lambda p: {})
    with net.name_scope():
        net.add(nn.Conv2D(8, 3, padding=1, in_channels=1, **kw("conv0_")), nn.BatchNorm(in_channels=8, **kw("bn_")),
                nn.Activation("relu"), nn.MaxPool2D(2), nn.Flatten(), nn.Dense(2, in_units=128, **kw("dense0_")))
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize(static_alloc=True)
    return net


def sgd_trainer(net, opt="sgd", lr=0.05, **kw):
    """A Trainer as AMP needs it (``update_on_kvstore=False``); SGD with momentum 0.9 by default."""
    params = kw.pop("optimizer_params", None) or ({"learning_rate": lr, "momentum": 0.9} if opt == "sgd"
                                                   else {"learning_rate": lr})
    kw.setdefault("update_on_kvstore", False)
    return gluon.Trainer(net.collect_params(), opt, params, **kw)


def import_gluoncv():
    """GluonCV, which ``make test`` installs (the [bench] extra): a missing one is an error."""
    import gluoncv
    return gluoncv


def no_bf16_env() -> dict:
    """Environment for a subprocess that behaves like an AVX2-only host on any CPU."""
    env = {**os.environ, "DNNL_MAX_CPU_ISA": "AVX2",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GLUON_AMP_SIMULATE_NATIVE_BF16", None)  # never a simulated native host
    return env

def check_graph(sym, policy, excluded=(), **input_types):
    """Return ``(violations, counts by reason)``; no violations when every op runs as decided.

    ``policy`` is a Policy (what ``init`` returns) or its OpTable."""
    table = getattr(policy, "table", None) or policy
    types = infer_dtypes(sym, {k: v for k, v in input_types.items()})
    assert types is not None, "infer_type could not type the whole graph"
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    infos = mxi.op_infos()
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


class FcDtype:
    """Which dtype an imperative ``FullyConnected`` ran in on the calling thread, told from its
    output: ``probe()`` hashes the output of a fixed product (inputs from ``seed``), and
    ``kinds()`` maps the hashes float32 and each emulated low dtype give to their names
    (``kinds()[probe()]``). ``kinds()`` enters and leaves emulated regions, then disables."""

    def __init__(self, seed: int) -> None:
        rng = np.random.RandomState(seed)
        self.x = mx.nd.array(rng.uniform(-3, 3, (4, 64)).astype("float32"))
        self.w = mx.nd.array(rng.uniform(-3, 3, (8, 64)).astype("float32"))

    def probe(self) -> str:
        out = mx.nd.FullyConnected(self.x, self.w, num_hidden=8, no_bias=True).asnumpy()
        return hashlib.sha1(out.tobytes()).hexdigest()

    def kinds(self) -> dict:
        import gluon_amp

        ref = {self.probe(): "float32"}
        for dt in ("float16", "bfloat16"):
            with gluon_amp.autocast(dt, emulate=True):
                ref[self.probe()] = dt
        gluon_amp.disable()
        assert len(ref) == 3
        return ref


def probe_host_items(host: str) -> list:
    """A recorded host's speed-probe items (tests/core/data/probe_hosts.json)."""
    with open(os.path.join(ROOT, "tests", "core", "data", "probe_hosts.json")) as f:
        return json.load(f)["hosts"][host]["items"]


@contextlib.contextmanager
def planted_probe(items, cache_dir):
    """This process's bfloat16 probe verdict read from ``items`` (records as the cache holds
    them), in a timing cache of its own under ``cache_dir``; the machine's own (or the
    simulation's) again after the block. Gives the verdict in force."""
    from gluon_amp import runtime
    from gluon_amp.speed import probe
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache_dir)
    runtime.timing_cache.cache_clear()
    probe.forget()
    try:
        runtime.timing_cache().store({probe._entry("bfloat16"): items})
        yield runtime.speed("bfloat16", warn=False)
    finally:
        if before is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = before
        runtime.timing_cache.cache_clear()
        probe.forget()


def train_bound(sym, arrays, out_grads):
    """``sym`` bound by ``simple_bind`` at ``arrays``' shapes, fed them, one forward and backward
    with ``out_grads``: its outputs and every argument's gradient, as NumPy arrays."""
    exe = sym.simple_bind(mx.cpu(), grad_req="write", **{k: v.shape for k, v in arrays.items()})
    for k, v in arrays.items():
        exe.arg_dict[k][:] = v
    exe.forward(is_train=True)
    exe.backward(out_grads)
    return [o.asnumpy() for o in exe.outputs], {k: g.asnumpy() for k, g in exe.grad_dict.items()}


#: The end of a subprocess script that trains ``net`` on ``x`` under ``init``: two steps of
#: ``(y * y).mean()``, then ``y`` (the last step's output) is ready.
TWO_STEPS = """
for _ in range(2):
    with mx.autograd.record():
        y = net(x)
        loss = (y * y).mean()
    loss.backward()
mx.nd.waitall()
"""


def verbose_run(script, args):
    """``script`` run by this Python with ``args`` (JSON) as its argument and ``DNNL_VERBOSE=1``:
    its output lines, and the JSON value of the line it printed after ``@@``."""
    import subprocess
    import sys
    env = dict(os.environ, DNNL_VERBOSE="1")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    return lines, json.loads(next(line for line in lines if line.startswith("@@"))[2:])


def backward(loss, trainer=None):
    """``loss.backward()``, through ``gluon_amp.scale_loss(loss, trainer)`` when a trainer is given."""
    import gluon_amp
    if trainer is None:
        loss.backward()
        return
    with gluon_amp.scale_loss(loss, trainer) as scaled:
        scaled.backward()
