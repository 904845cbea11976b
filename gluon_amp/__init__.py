"""gluon_amp: automatic mixed precision for MXNet Gluon.

Quick start::

    import gluon_amp as amp
    amp.init()                      # float16 on GPU, bfloat16 on CPU
    net = build_net(); net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {...}, update_on_kvstore=False)
    amp.init_trainer(trainer)
    with autograd.record():
        loss = loss_fn(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(batch_size)
"""
from ._compat import check_numpy as _check_numpy

_check_numpy()

from ._numpy_shim import restore_numpy_aliases as _restore_numpy_aliases  # noqa: E402

_restore_numpy_aliases()  # before anything imports MXNet (docs/python.md)

from . import runtime as _runtime  # noqa: E402

_runtime.enable_amx()  # before MXNet creates its first oneDNN primitive

from ._compat import import_mxnet as _import_mxnet  # noqa: E402

_import_mxnet()
_runtime.settle_isa()  # oneDNN has read the AMX cap: child processes must not inherit it

from .mxnet_internals import drain_before_mxnet_shutdown as _drain_at_exit  # noqa: E402

_drain_at_exit()  # MXNet's exit hangs on custom-op work still queued (mxnet_internals/shutdown.py)

from .convert import convert_hybrid_block, convert_model, convert_symbol  # noqa: E402
from .convert.bucketing import convert_bucketing_module  # noqa: E402
from .lists_api import (  # noqa: E402
    list_conditional_fp32_ops, list_fp32_ops, list_lp16_fp32_ops, list_lp16_ops,
    list_widest_type_cast, list_loss_output_functions, list_lp16_use_fp32_params,
)
from gluon_amp_core.loss_scale import LossScaler, ScaleState  # noqa: E402
from gluon_amp_core.policy import Policy  # noqa: E402
from .patching import (  # noqa: E402
    autocast, current_policy, disable, init, is_enabled, patched_functions,
)
from .policy_builder import make_policy  # noqa: E402
from .opt_levels import initialize  # noqa: E402
from . import debug  # noqa: E402
from .reporting.report import Report, report  # noqa: E402
from .reporting.info import runtime_info  # noqa: E402
from .training.distributed import init_kvstore  # noqa: E402
from .launch import install_as_contrib_amp, uninstall_contrib_amp  # noqa: E402
from .training.trainer import (  # noqa: E402
    clip_global_norm, get_scaler, init_trainer, load_states, save_states, scale_loss, unscale,
)
from gluon_amp_core.table import OpClass, OpListError, OpListTypeError, OpTable  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "init", "disable", "autocast", "is_enabled", "current_policy", "patched_functions",
    "Policy", "make_policy",
    "list_lp16_ops", "list_fp32_ops", "list_lp16_fp32_ops", "list_conditional_fp32_ops",
    "list_widest_type_cast", "runtime_info", "OpClass", "OpTable", "OpListError", "OpListTypeError",
    "LossScaler", "ScaleState", "init_trainer", "scale_loss", "unscale", "clip_global_norm",
    "get_scaler", "save_states", "load_states", "initialize", "init_kvstore",
    "convert_symbol", "convert_model", "convert_hybrid_block", "report", "Report",
    "convert_bucketing_module", "list_loss_output_functions", "list_lp16_use_fp32_params", "debug",
    "install_as_contrib_amp", "uninstall_contrib_amp",
]
