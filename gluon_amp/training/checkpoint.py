"""Trainer checkpoints that carry no code: safe to load, written atomically.

A checkpoint is a zip file: ``meta.json`` (the format, the loss scaler, the mode of
mixed precision, the optimizer's hyper-parameters and the shape of its state tree) and one
``.npy`` array per optimizer state tensor. Loading reads JSON and arrays with
``allow_pickle=False``: nothing from the file is ever executed.

Files written by gluon_amp before this format (a pickle) are refused unless the caller
trusts them (``load_states(..., trusted=True)``, or ``python -m gluon_amp.training.checkpoint
upgrade OLD NEW`` once). Their outer layer is read with an unpickler that resolves no
global at all, so a ``__reduce__`` payload is refused before it runs.

    python -m gluon_amp.training.checkpoint upgrade OLD.states NEW.states
"""
from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tempfile
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import mxnet as mx
import numpy as np

from gluon_amp_core.dtypes import dtype_name

from .master_weights import MasterState

FORMAT = "gluon_amp.checkpoint"
VERSION = 2
#: What ``save_states`` wrote before this format: a pickle of {"format": OLD_FORMAT, ...}.
OLD_FORMAT = "gluon_amp.trainer_states.v1"
_SCALARS = (bool, int, float, str, type(None))


class CheckpointError(ValueError):
    """A file that is not a gluon_amp checkpoint this version can load safely."""


# -- the state tree -----------------------------------------------------------------------

class _Encoder:
    """Optimizer states (NDArrays, tuples, lists, dicts, MasterState, numbers) as JSON plus arrays."""

    def __init__(self) -> None:
        self.arrays: Dict[str, np.ndarray] = {}

    def encode(self, x: Any) -> Any:
        if isinstance(x, mx.nd.NDArray):
            key = f"a{len(self.arrays)}"
            dtype = dtype_name(x.dtype)
            self.arrays[key] = (mx.nd.amp_cast(x, dtype="float32") if dtype == "bfloat16" else x).asnumpy()
            return {"t": "nd", "key": key, "dtype": dtype}
        if isinstance(x, MasterState):
            return {"t": "master", "master": self.encode(x.master), "inner": self.encode(x.inner)}
        if isinstance(x, (tuple, list)):
            return {"t": type(x).__name__, "items": [self.encode(v) for v in x]}
        if isinstance(x, dict):
            return {"t": "dict", "items": [[self.encode(k), self.encode(v)] for k, v in x.items()]}
        if isinstance(x, _SCALARS):
            return {"t": "scalar", "v": x}
        raise TypeError(f"save_states cannot store an optimizer state of type {type(x).__name__} "
                        "(supported: NDArrays, tuples, lists, dicts, numbers, None)")


def _decode(x: Any, arrays: Dict[str, np.ndarray], ctx: mx.Context) -> Any:
    kind = x["t"]
    if kind == "nd":
        arr = mx.nd.array(arrays[x["key"]], ctx=ctx, dtype="float32")
        dtype = x["dtype"]
        if dtype == "float32":
            return arr
        from ..mxnet_internals import to_mx_dtype
        return mx.nd.amp_cast(arr, dtype=to_mx_dtype(dtype)) if dtype in ("bfloat16", "float16") else \
            mx.nd.array(arrays[x["key"]], ctx=ctx, dtype=dtype)
    if kind == "master":
        return MasterState(_decode(x["master"], arrays, ctx), _decode(x["inner"], arrays, ctx))
    if kind in ("tuple", "list"):
        items = [_decode(v, arrays, ctx) for v in x["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {_decode(k, arrays, ctx): _decode(v, arrays, ctx) for k, v in x["items"]}
    if kind == "scalar":
        return x["v"]
    raise CheckpointError(f"unknown state entry {kind!r} in the checkpoint (written by a newer gluon_amp?)")


# -- the optimizer's hyper-parameters -----------------------------------------------------

def _plain(v: Any) -> bool:
    if isinstance(v, _SCALARS):
        return True
    if isinstance(v, dict):
        return all(isinstance(k, (int, str)) and _plain(x) for k, x in v.items())
    return False


def _jsonable(d: Dict[Any, Any]) -> List[List[Any]]:
    return [[k, _jsonable(v) if isinstance(v, dict) else v] for k, v in d.items()]


def _from_json(items: List[List[Any]]) -> Dict[Any, Any]:
    return {k: _from_json(v) if isinstance(v, list) and all(isinstance(i, list) and len(i) == 2 for i in v)
            else v for k, v in items}


def optimizer_fields(opt: Any) -> Dict[str, Any]:
    """The optimizer's plain attributes (learning rate, update counts, momentum, ...) and
    its LR scheduler's: what restores its schedule, without the object itself."""
    fields = {k: v for k, v in vars(opt).items() if _plain(v) and k not in ("param_dict", "idx2name")}
    sched = getattr(opt, "lr_scheduler", None)
    return {"class": type(opt).__name__, "fields": _jsonable(fields),
            "lr_scheduler": None if sched is None else {"class": type(sched).__name__, "fields": _jsonable(
                {k: v for k, v in vars(sched).items() if _plain(v)})}}


def restore_optimizer(opt: Any, saved: Dict[str, Any]) -> None:
    """Set ``saved`` (from :func:`optimizer_fields`) on the trainer's own optimizer."""
    if type(opt).__name__ != saved["class"]:
        raise CheckpointError(f"the checkpoint was saved with optimizer {saved['class']!r}, this trainer has "
                              f"{type(opt).__name__!r}; build the Trainer with the same optimizer")
    for k, v in _from_json(saved["fields"]).items():
        setattr(opt, k, v)
    if "_all_index_update_counts" in vars(opt):  # MXNet 1.9: the per-device counts alias the first
        opt._index_update_count = opt._all_index_update_counts[0]
    sched, want = getattr(opt, "lr_scheduler", None), saved["lr_scheduler"]
    if (sched is None) != (want is None) or (sched is not None and type(sched).__name__ != want["class"]):
        raise CheckpointError(f"the checkpoint's LR scheduler {want and want['class']!r} differs from this "
                              f"trainer's {sched and type(sched).__name__!r}; build the Trainer with the same one")
    if sched is not None:
        for k, v in _from_json(want["fields"]).items():
            setattr(sched, k, v)


# -- files --------------------------------------------------------------------------------

def write(path: str, meta: Dict[str, Any], states: Dict[Any, Any], opt: Any) -> None:
    """Write a checkpoint atomically: a temporary file in the same directory, flushed and
    fsynced, then renamed over ``path``. A failed save leaves the previous file as it was."""
    enc = _Encoder()
    doc = {"format": FORMAT, "version": VERSION, **meta, "optimizer": optimizer_fields(opt),
           "states": enc.encode(states)}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gluon_amp-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
                z.writestr("meta.json", json.dumps(doc))
                for key, arr in enc.arrays.items():
                    buf = io.BytesIO()
                    np.lib.format.write_array(buf, arr, allow_pickle=False)
                    z.writestr(f"arrays/{key}.npy", buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str, ctx: mx.Context) -> Tuple[Dict[str, Any], Callable[[], Dict[Any, Any]]]:
    """``(meta, make_states)`` of a checkpoint; ``make_states()`` builds fresh state arrays."""
    if not os.path.isfile(path):
        raise ValueError(f"load_states: no such file {path!r}")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(_not_ours(path))
    with zipfile.ZipFile(path) as z:
        try:
            doc = json.loads(z.read("meta.json"))
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{path!r} is not a gluon_amp.save_states file ({exc})") from None
        if doc.get("format") != FORMAT or not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
            raise CheckpointError(f"{path!r} is not a gluon_amp.save_states file of version <= {VERSION}")
        try:
            arrays = {name[len("arrays/"):-len(".npy")]: np.lib.format.read_array(io.BytesIO(z.read(name)),
                                                                                   allow_pickle=False)
                      for name in z.namelist() if name.startswith("arrays/")}
        except ValueError as exc:  # e.g. an object array, which would need pickle
            raise CheckpointError(f"{path!r} holds an array gluon_amp will not load: {exc}") from None
    tree = doc.pop("states")
    return doc, lambda: _decode(tree, arrays, ctx)


class _NoGlobals(pickle.Unpickler):
    """Reads plain containers, strings, bytes and numbers; refuses every class or function."""

    def find_class(self, module: str, name: str) -> Any:
        raise CheckpointError(f"refused to load {module}.{name} from the file: a gluon_amp checkpoint "
                              "contains no code or classes")


def _not_ours(path: str) -> str:
    """Why a non-zip file is refused, read without running anything from it."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] != b"\x80":
        return f"{path!r} is not a gluon_amp.save_states file"
    try:
        with open(path, "rb") as f:
            old = _NoGlobals(f).load()
    except CheckpointError as exc:
        return (f"{path!r} is not a gluon_amp checkpoint: its pickle names a class ({exc}). A plain "
                "Trainer.save_states file loads with trainer.load_states(fname); like any pickle, only "
                "load files you trust.")
    except Exception as exc:  # a truncated or corrupt pickle
        return f"{path!r} is not a gluon_amp.save_states file ({exc})"
    if isinstance(old, dict) and old.get("format") == OLD_FORMAT:
        return (f"{path!r} was written by an older gluon_amp as a pickle, which can run code when loaded. "
                "If you trust it, load it with gluon_amp.load_states(trainer, fname, trusted=True), or "
                "convert it once: python -m gluon_amp.training.checkpoint upgrade OLD NEW.")
    return f"{path!r} is not a gluon_amp.save_states file"


def read_old(path: str) -> Tuple[Dict[str, Any], Dict[Any, Any], Any]:
    """``(scaler state, optimizer states, optimizer)`` of an old pickle checkpoint. Runs
    pickle: only for files the caller trusts."""
    with open(path, "rb") as f:
        old = pickle.load(f)  # noqa: S301 - trusted by the caller, see load_states(trusted=True)
    if not isinstance(old, dict) or old.get("format") != OLD_FORMAT:
        raise CheckpointError(f"{path!r} is not an old gluon_amp.save_states file")
    states = pickle.loads(old["trainer"])  # noqa: S301 - MXNet's own Updater.get_states blob
    states, opt = states if isinstance(states, tuple) and len(states) == 2 else (states, None)
    return old["scaler"], states, opt


def upgrade(old_path: str, new_path: str) -> None:
    """Rewrite a trusted old (pickle) checkpoint in the current format."""
    scaler, states, opt = read_old(old_path)
    if opt is None:
        raise CheckpointError(f"{old_path!r} holds no optimizer (saved without dump_optimizer); re-save it "
                              "from a trainer with gluon_amp.save_states")
    write(new_path, {"scaler": scaler, "mode": None}, states, opt)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "upgrade":
        print("usage: python -m gluon_amp.training.checkpoint upgrade OLD NEW  (OLD: a trusted pickle checkpoint)",
              file=sys.stderr)
        return 2
    try:
        upgrade(args[1], args[2])
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"upgraded {args[1]} -> {args[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
