"""``mx.library.load`` under a policy: MXNet generates every ``mx.nd``/``mx.sym`` op function
again after loading an extension library, and the new functions must run the policy too.

Found by a helper running MXNet's extension examples: after the load AMP went on reporting
itself on (``is_enabled()``, ``runtime_info``) while every op ran float32, silently. Each case
runs in a fresh process (a load changes MXNet's op functions for good), on a minimal extension
library built from the ``lib_api`` MXNet's wheel ships.
"""
import json
import os
import subprocess
import sys

import mxnet as mx
import pytest

_MXNET = os.path.dirname(mx.__file__)

_PROGRAM = r"""
import json, sys
import numpy as np
import gluon_amp
import mxnet as mx
from mxnet.ndarray import FullyConnected as fc_taken_before  # before the load, as imports are

library, dtype, order = sys.argv[1:4]
data = mx.nd.array(np.linspace(0.001, 1.2345, 6).reshape(2, 3))
weight = mx.nd.array(np.linspace(-0.7, 0.9, 12).reshape(4, 3))


def outputs():
    fc = mx.nd.FullyConnected(data, weight, no_bias=True, num_hidden=4).asnumpy()
    early = fc_taken_before(data, weight, no_bias=True, num_hidden=4).asnumpy()
    net = mx.gluon.nn.Dense(4, in_units=3, use_bias=False)
    net.initialize()
    net.weight.set_data(weight)
    net.hybridize()
    sym = mx.gluon.SymbolBlock(mx.sym.FullyConnected(mx.sym.var("x"), num_hidden=4, no_bias=True, name="fc"),
                               [mx.sym.var("x")])
    sym.initialize()
    sym.collect_params()["fc_weight"].set_data(weight)
    return [fc.tolist(), early.tolist(), net(data).asnumpy().tolist(), sym(data).asnumpy().tolist()]


plain_before = outputs()
old = mx.nd.FullyConnected
if order == "init, load":
    gluon_amp.init(target_dtype=dtype, emulate=True)
    before = outputs()
    mx.library.load(library)
else:  # "load, init": the load came first, when nothing was patched
    mx.library.load(library)
    gluon_amp.init(target_dtype=dtype, emulate=True)
    before = None
after = outputs()
regenerated = mx.nd.FullyConnected is not old
gluon_amp.disable()
plain = outputs()
print(json.dumps(dict(plain_before=plain_before, before=before, after=after, plain=plain,
                      regenerated=regenerated)))
"""


@pytest.fixture(scope="module")
def extension_library(tmp_path_factory):
    """A minimal MXNet extension library (no ops, no passes), built with the wheel's lib_api."""
    folder = tmp_path_factory.mktemp("extension")
    source = folder / "empty.cc"
    source.write_text('#include "mxnet/lib_api.h"\n'
                      "using namespace mxnet::ext;\n"
                      "MXReturnValue initialize(int version) { return MX_SUCCESS; }\n")
    library = folder / "libempty.so"
    subprocess.run([os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-std=c++11", str(source),
                    os.path.join(_MXNET, "src", "lib_api.cc"), "-I", os.path.join(_MXNET, "include"),
                    "-o", str(library)], check=True, capture_output=True, timeout=300)
    return str(library)


@pytest.mark.parametrize("order", ["init, load", "load, init"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_policy_holds_after_a_library_load(extension_library, dtype, order):
    """Every entry point runs the policy after the load as before it: the op functions MXNet
    generated again, a reference taken before the load, a hybridized block and a SymbolBlock;
    a load before ``init`` too. ``disable()`` gives MXNet's float32 back everywhere."""
    r = subprocess.run([sys.executable, "-c", _PROGRAM, extension_library, dtype, order],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["regenerated"], "MXNet did not generate its op functions again: the case tests nothing"
    plain = got["plain_before"]
    assert all(a != p for a, p in zip(got["after"], plain)), got  # each entry point ran the policy
    assert all(a == got["after"][0] for a in got["after"]), got["after"]  # and the same plan
    if got["before"] is not None:
        assert got["after"] == got["before"], (got["after"], got["before"])
    assert got["plain"] == plain, (got["plain"], plain)  # disable(): MXNet's float32 everywhere
