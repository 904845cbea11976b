"""Every use gluon_amp makes of MXNet internals, in one package: nothing else in gluon_amp
touches them. Each function names the MXNet version it was checked against (1.9.1) and what
breaks if MXNet changes it. Import it as ``from . import mxnet_internals as mxi``.

``arrays`` dtypes, host views | ``registry`` op functions and their infos |
``code_swap`` the in-place swap init uses | ``gluon`` blocks, symbols, hooks | ``trainer``
trainer, parameter and updater internals | ``custom_ops`` loading gluon_amp's compiled ops |
``simulated`` bfloat16 kernels of a simulated native host (tests) | ``graph_reads`` a symbol's
graph read once per chain of passes | ``warning_sites`` MXNet's warnings past the hooks' frames |
``errors`` the line of an MXNet error that says what failed | ``versions`` how many writes an
array took | ``forward_only`` a block's calls that record nothing, on casts made once |
``padded_inputs`` a block's CachedOp fed an image with a zero channel more | ``shutdown``
queued work done before MXNet stops its custom-op thread at exit | ``quiet`` MXNet's
prints, log lines and binds' partitioning silenced, safely with threads.
"""
from .arrays import *  # noqa: F401,F403
from .code_swap import *  # noqa: F401,F403
from .gluon import *  # noqa: F401,F403
from .registry import *  # noqa: F401,F403
from .trainer import *  # noqa: F401,F403
from .arrays import BFLOAT16, FLOAT_NAMES, host_view, legacy, to_mx_dtype  # noqa: F401
from .quiet import quiet_stderr, quiet_stdout, unfused_binds  # noqa: F401
from .code_swap import (SavedFunction, copy_function, is_redirected_to, original_function,  # noqa: F401
                        redirect, restore, retarget)
from .custom_ops import *  # noqa: F401,F403
from .shutdown import drain_before_mxnet_shutdown  # noqa: F401
from .simulated import *  # noqa: F401,F403
from .graph_reads import internal_entries, shared_reads, symbol_graph, symbol_json  # noqa: F401
from .errors import error_line  # noqa: F401
from .function_hooks import install_grad_hook, install_library_hook, remove_function_hook  # noqa: F401
from .forward_only import ForwardOnly, casts_storable  # noqa: F401
from . import forward_only  # noqa: F401,E402  (mxi.forward_only.Made, .cast)
from . import padded_inputs  # noqa: F401,E402  (mxi.padded_inputs.record_pads)
from .warning_sites import MXNET_PACKAGE, warn as warn_outside  # noqa: F401
from .openmp import omp_threads  # noqa: F401
from . import module  # noqa: F401,E402  (Module internals: mxi.module.*, imported where used)
