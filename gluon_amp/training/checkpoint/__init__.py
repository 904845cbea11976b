"""Trainer checkpoints that carry no code: safe to load, written atomically.

A checkpoint is a zip file: ``meta.json`` (the format, the loss scaler, the mode of
mixed precision, the optimizer's hyper-parameters and the shape of its state tree) and one
``.npy`` array per optimizer state tensor. Loading reads JSON and arrays with
``allow_pickle=False``: nothing from the file is ever executed.

A load checks everything before it changes anything (:func:`read`, :func:`check_params`,
:func:`check_optimizer`): the zip and every member's CRC, meta.json's fields, every array the
state tree names (and no other), the scaler's values, the state tree against the trainer's
parameters. Any damage raises :class:`CheckpointError` naming the file and what is wrong.

Files written by gluon_amp before this format (a pickle) are refused unless the caller
trusts them (``load_states(..., trusted=True)``, or ``python -m gluon_amp.training.checkpoint
upgrade OLD NEW`` once). Their outer layer is read with an unpickler that resolves no
global at all, so a ``__reduce__`` payload is refused before it runs.

    python -m gluon_amp.training.checkpoint upgrade OLD.states NEW.states
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import socket
import stat
import struct
import sys
import tempfile
import time
import zipfile
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np

from gluon_amp_core.dtypes import dtype_name
from gluon_amp_core.durable import fsync_path, held_by_another, hold_exclusive, replacement_mode

from ... import mxnet_internals as mxi
from ..master_weights import MasterState

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
            x = mxi.legacy(x)  # amp_cast refuses numpy-mode arrays
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
        from ...mxnet_internals import to_mx_dtype
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


#: optimizer attributes that are not its state: the trainer's own objects, set up again by it
_NOT_STATE = ("param_dict", "idx2name", "sym_info", "lr_scheduler")


def _holds_array(v: Any) -> bool:
    if isinstance(v, mx.nd.NDArray):
        return True
    if isinstance(v, dict):
        return any(_holds_array(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_holds_array(x) for x in v)


def optimizer_arrays(opt: Any) -> Dict[str, Any]:
    """The optimizer's attributes that hold arrays (LBSGD's gradients summed over a
    macro-batch, ``cumgrads``): state a resumed run needs as much as the updaters'."""
    return {k: v for k, v in vars(opt).items() if k not in _NOT_STATE and not _plain(v) and _holds_array(v)}


def optimizer_fields(opt: Any) -> Dict[str, Any]:
    """The optimizer's plain attributes (learning rate, update counts, momentum, ...) and
    its LR scheduler's: what restores its schedule, without the object itself."""
    fields = {k: v for k, v in vars(opt).items() if _plain(v) and k not in ("param_dict", "idx2name")}
    sched = getattr(opt, "lr_scheduler", None)
    return {"class": type(opt).__name__, "fields": _jsonable(fields),
            "lr_scheduler": None if sched is None else {"class": type(sched).__name__, "fields": _jsonable(
                {k: v for k, v in vars(sched).items() if _plain(v)})}}


def check_optimizer(opt: Any, saved: Any, path: str) -> Dict[str, Any]:
    """The optimizer's and its LR scheduler's fields as ``saved`` (from
    :func:`optimizer_fields`) sets them, checked against ``opt``; nothing is changed."""
    if type(opt).__name__ != saved["class"]:
        raise CheckpointError(f"{path!r} was saved with optimizer {saved['class']!r}, this trainer has "
                              f"{type(opt).__name__!r}; build the Trainer with the same optimizer")
    sched, want = getattr(opt, "lr_scheduler", None), saved["lr_scheduler"]
    if (sched is None) != (want is None) or (sched is not None and type(sched).__name__ != want["class"]):
        raise CheckpointError(f"{path!r}: its LR scheduler {want and want['class']!r} differs from this "
                              f"trainer's {sched and type(sched).__name__!r}; build the Trainer with the same one")
    fields = _from_json(saved["fields"])
    if "_all_index_update_counts" in {**vars(opt), **fields}:  # MXNet 1.9: the per-device counts alias the first
        fields["_index_update_count"] = {**vars(opt), **fields}["_all_index_update_counts"][0]
    return {"optimizer": fields, "lr_scheduler": _from_json(want["fields"]) if want is not None else None}


def reindexed_fields(checked: Dict[str, Any], moved: Optional[Dict[int, int]]) -> Dict[str, Any]:
    """:func:`check_optimizer`'s fields with the per-parameter update counts (Adam's bias
    correction reads them) under the indices :func:`check_params` moved them to."""
    if moved is None:
        return checked
    fields = dict(checked["optimizer"])
    counts = fields.get("_all_index_update_counts")
    if isinstance(counts, dict):  # MXNet 1.9: per device; _index_update_count aliases device 0's
        counts = {dev: reindexed(c, moved) if isinstance(c, dict) else c for dev, c in counts.items()}
        fields["_all_index_update_counts"] = counts
        if 0 in counts:
            fields["_index_update_count"] = counts[0]
    elif isinstance(fields.get("_index_update_count"), dict):
        fields["_index_update_count"] = reindexed(fields["_index_update_count"], moved)
    return {**checked, "optimizer": fields}


def restore_optimizer(opt: Any, checked: Dict[str, Any]) -> None:
    """Set what :func:`check_optimizer` gave on the trainer's own optimizer (one C call per object)."""
    vars(opt).update(checked["optimizer"])
    if checked["lr_scheduler"] is not None:
        vars(opt.lr_scheduler).update(checked["lr_scheduler"])


# -- files --------------------------------------------------------------------------------

#: a save's temporary file: ``.gluon_amp-<host>-<pid>-<random>.tmp`` beside the checkpoint
_TMP_PREFIX = ".gluon_amp-"
_TMP_SUFFIX = ".tmp"
#: a temporary file left this long without a write is a dead save's, whoever wrote it
_STALE_AFTER_S = 24 * 3600.0


def _host() -> str:
    """This machine and PID namespace, as a file name part. Two containers with one hostname
    (or names alike in their first characters) saving to a shared folder get tags of their
    own: a pid is looked up only where it means something."""
    name = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    digest = hashlib.sha1(f"{name}\0{namespace}".encode()).hexdigest()[:10]
    return ("".join(c if c.isalnum() else "_" for c in name)[:24] or "host") + "_" + digest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: a process of another user has that pid
        return True
    return True


def clean_stale_temporaries(directory: str) -> List[str]:
    """Remove the temporary files of dead saves (killed mid-save); return their names. Dead:
    written here (this host and PID namespace) by a pid that is gone, or untouched for
    :data:`_STALE_AFTER_S` whoever wrote it. A file its writer still holds locked is left."""
    removed = []
    host = _host()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not (name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX)):
            continue
        full = os.path.join(directory, name)
        parts = name[len(_TMP_PREFIX):-len(_TMP_SUFFIX)].rsplit("-", 2)
        mine = len(parts) == 3 and parts[0] == host and parts[1].isdigit()
        dead = mine and int(parts[1]) != os.getpid() and not _pid_alive(int(parts[1]))
        try:
            old = now - os.stat(full).st_mtime > _STALE_AFTER_S
        except OSError:
            continue
        if not (dead or old) or held_by_another(full):
            continue
        try:
            os.unlink(full)
            removed.append(name)
        except OSError:
            pass
    return removed


def checked_path(path: Any, caller: str) -> str:
    """``path`` as a file name: a str or os.PathLike naming a file, else a TypeError or
    ValueError naming it (an int is no file name here, as Python's ``open`` would take a
    descriptor; an empty name and a directory have no file to write or read)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{caller}: the file name must be a str or os.PathLike path, got "
                        f"{type(path).__name__} {path!r}")
    path = os.fspath(path)
    if not path or os.path.isdir(path):
        raise ValueError(f"{caller}: {path!r} is {'empty' if not path else 'a directory'}; give the path "
                         "of a file, such as 'trainer.states'")
    return path


def _kind(path: str) -> str:
    mode = os.stat(path).st_mode
    return ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def write(path: str, meta: Dict[str, Any], states: Dict[Any, Any], opt: Any,
          params: Optional[List[Tuple[str, Tuple[int, ...], str]]] = None) -> None:
    """Write a checkpoint atomically: a temporary file in the same directory, flushed and
    fsynced, then renamed over ``path``. A failed save leaves the previous file as it was;
    a killed one leaves its temporary file, which the next save in that directory removes.
    ``params``: (name, shape, dtype) of each parameter, in the order of the state tree's indices."""
    path = checked_path(path, "save_states")
    enc = _Encoder()
    doc = {"format": FORMAT, "version": VERSION, **meta, "optimizer": optimizer_fields(opt),
           "states": enc.encode(states)}
    held = optimizer_arrays(opt)
    if held:
        doc["optimizer"]["arrays"] = enc.encode(held)
    if params is not None:
        doc["params"] = [[n, list(shape), d] for n, shape, d in params]
    target = os.path.realpath(path)  # a link is written through, as MXNet's own saves do
    if os.path.islink(target):  # realpath gave up: the links loop
        raise OSError(errno.ELOOP, f"save_states: {path!r} is a loop of symbolic links")
    if os.path.exists(target) and not os.path.isfile(target):  # a device (os.devnull), a pipe, a socket
        raise ValueError(f"save_states: {path!r} is no regular file ({_kind(target)}), which an atomic save "
                         "would replace; give the path of a file, such as 'trainer.states'")
    directory = os.path.dirname(target)
    clean_stale_temporaries(directory)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{_host()}-{os.getpid()}-", suffix=_TMP_SUFFIX,
                                   dir=directory)
    except OSError as exc:  # the user's path, not the name of a file they never asked for
        raise type(exc)(exc.errno, f"save_states: cannot write a file in {directory!r} for {path!r}: "
                                   f"{exc.strerror}") from exc
    try:
        hold_exclusive(fd)  # while it is written: another process's cleaning leaves it
        try:
            os.chmod(tmp, replacement_mode(target))  # mkstemp's 0600 would lock out its readers
        except OSError:  # a file system without modes
            pass
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
                z.writestr("meta.json", json.dumps(doc))
                for key, arr in enc.arrays.items():
                    buf = io.BytesIO()
                    np.lib.format.write_array(buf, arr, allow_pickle=False)
                    z.writestr(f"arrays/{key}.npy", buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_path(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise



class Checkpoint:
    """A checkpoint read and checked: ``meta`` (meta.json without the tree), the state tree,
    its arrays, and the shapes of the arrays under each top-level index."""

    def __init__(self, meta: Dict[str, Any], tree: Any, arrays: Dict[str, np.ndarray],
                 shapes: Dict[Any, List[Tuple[int, ...]]]) -> None:
        self.meta, self.tree, self.arrays, self.shapes = meta, tree, arrays, shapes

    def states(self, ctx: mx.Context) -> Dict[Any, Any]:
        """Fresh state arrays (on ``ctx``) for one updater."""
        return _decode(self.tree, self.arrays, ctx)

    @property
    def holds_optimizer_arrays(self) -> bool:
        return self.meta["optimizer"].get("arrays") is not None

    def optimizer_arrays(self, ctx: mx.Context, moved: Optional[Dict[int, int]] = None) -> Dict[str, Any]:
        """The optimizer's attributes that held arrays (:func:`optimizer_arrays`), fresh on
        ``ctx``; those keyed by parameter index under the indices :func:`check_params` gave."""
        held = self.meta["optimizer"].get("arrays")
        if held is None:
            return {}
        return {k: reindexed(v, moved) if isinstance(v, dict) else v
                for k, v in _decode(held, self.arrays, ctx).items()}


_KINDS = ("nd", "master", "tuple", "list", "dict", "scalar")
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


def _check_tree(node: Any, arrays: Dict[str, np.ndarray], used: List[str], shapes: List[Tuple[int, ...]],
                depth: int = 0) -> None:
    """``node`` is a state tree :class:`_Encoder` writes, naming arrays that exist; raises
    ``ValueError`` (made a CheckpointError by :func:`read`) for anything else."""
    if depth > 32 or not isinstance(node, dict) or node.get("t") not in _KINDS:
        raise ValueError(f"a state entry is not one gluon_amp writes: {str(node)[:80]}")
    kind = node["t"]
    if kind == "nd":
        key, dtype = node.get("key"), node.get("dtype")
        if not isinstance(key, str) or key not in arrays:
            raise ValueError(f"the state tree names array {key!r}, which the file does not hold")
        if dtype not in _DTYPES:
            raise ValueError(f"array {key!r} has dtype {dtype!r}, not one of {list(_DTYPES)}")
        used.append(key)
        shapes.append(tuple(arrays[key].shape))
    elif kind == "master":
        _check_tree(node.get("master"), arrays, used, shapes, depth + 1)
        _check_tree(node.get("inner"), arrays, used, shapes, depth + 1)
    elif kind in ("tuple", "list"):
        items = node.get("items")
        if not isinstance(items, list):
            raise ValueError(f"a {kind} entry without its items: {str(node)[:80]}")
        for v in items:
            _check_tree(v, arrays, used, shapes, depth + 1)
    elif kind == "dict":
        items = node.get("items")
        if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
            raise ValueError(f"a dict entry without its items: {str(node)[:80]}")
        for k, v in items:
            _check_tree(k, arrays, used, shapes, depth + 1)
            _check_tree(v, arrays, used, shapes, depth + 1)
    elif not isinstance(node.get("v"), _SCALARS) or "v" not in node:
        raise ValueError(f"a scalar entry holds {node.get('v')!r}")


def _check_doc(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise ValueError("meta.json is not an object")
    for key, kinds in (("scaler", dict), ("optimizer", dict), ("states", dict)):
        if not isinstance(doc.get(key), kinds):
            raise ValueError(f"meta.json has no {key!r} object")
    if not isinstance(doc.get("mode"), (dict, type(None))):
        raise ValueError("meta.json's 'mode' is not an object")
    opt = doc["optimizer"]
    if not isinstance(opt.get("class"), str) or not isinstance(opt.get("fields"), list) or not (
            opt.get("lr_scheduler") is None or (isinstance(opt["lr_scheduler"], dict)
                                               and isinstance(opt["lr_scheduler"].get("class"), str)
                                               and isinstance(opt["lr_scheduler"].get("fields"), list))):
        raise ValueError("meta.json's 'optimizer' is not what gluon_amp writes")
    _from_json(opt["fields"])
    if opt.get("lr_scheduler") is not None:
        _from_json(opt["lr_scheduler"]["fields"])
    if opt.get("arrays") is not None and not (isinstance(opt["arrays"], dict) and opt["arrays"].get("t") == "dict"):
        raise ValueError("meta.json's optimizer arrays are not a dict of attributes")
    params = doc.get("params")
    if params is not None and not (isinstance(params, list) and all(
            isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[2], str)
            and isinstance(p[1], list) and all(isinstance(d, int) and d >= 0 for d in p[1]) for p in params)):
        raise ValueError("meta.json's 'params' is not a list of [name, shape, dtype]")
    if doc["states"].get("t") != "dict":
        raise ValueError("the state tree is not a dict of parameter indices")


#: what zipfile, zlib, json, NumPy's .npy reader and the checks below raise on damaged bytes
_DAMAGE = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, struct.error, EOFError, KeyError, IndexError,
           ValueError, TypeError, AttributeError, NotImplementedError, OverflowError, RecursionError)


def read(path: str) -> Checkpoint:
    """Read and check a checkpoint; :class:`CheckpointError` naming the file and what is
    wrong for any damage (a CRC, a member missing or extra, meta.json's fields, the tree)."""
    path = checked_path(path, "load_states")
    if not os.path.isfile(path):
        raise ValueError(f"load_states: no such file {path!r}")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(_not_ours(path))
    with open(path, "rb") as f:
        data = f.read()
    try:
        return _parse(path, data)
    except CheckpointError:
        raise
    except _DAMAGE as exc:  # what parsing damaged bytes raises (an error of ours or a MemoryError stays itself)
        raise CheckpointError(f"{path!r} is damaged or not a whole gluon_amp checkpoint "
                              f"({type(exc).__name__}: {exc}); load an older checkpoint") from None


def _parse(path: str, data: bytes) -> Checkpoint:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = z.namelist()
        if len(set(names)) != len(names):
            raise ValueError("a member appears twice")
        if "meta.json" not in names:
            raise CheckpointError(f"{path!r} is not a gluon_amp.save_states file (no meta.json)")
        doc = json.loads(z.read("meta.json"))  # reading checks each member's CRC
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("version"), int) \
                or doc["version"] > VERSION:
            raise CheckpointError(f"{path!r} is not a gluon_amp.save_states file of version <= {VERSION}")
        _check_doc(doc)
        arrays: Dict[str, np.ndarray] = {}
        for name in names:
            if name == "meta.json":
                continue
            if not (name.startswith("arrays/") and name.endswith(".npy")):
                raise ValueError(f"unexpected member {name!r}")
            try:
                arr = np.lib.format.read_array(io.BytesIO(z.read(name)), allow_pickle=False)
            except ValueError as exc:  # e.g. an object array, which would need pickle
                raise CheckpointError(f"{path!r} holds an array gluon_amp will not load: {exc}") from None
            if arr.dtype.kind not in "fiub":
                raise ValueError(f"member {name!r} holds a {arr.dtype} array")
            arrays[name[len("arrays/"):-len(".npy")]] = arr
    tree = doc.pop("states")
    used: List[str] = []
    shapes: Dict[Any, List[Tuple[int, ...]]] = {}
    for kv in tree.get("items") if isinstance(tree.get("items"), list) else [None]:
        if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], dict) and kv[0].get("t") == "scalar"
                and isinstance(kv[0].get("v"), int) and not isinstance(kv[0].get("v"), bool)):
            raise ValueError("the state tree's keys are not parameter indices")
        shapes[kv[0]["v"]] = found = []
        _check_tree(kv[1], arrays, used, found)
    if doc["optimizer"].get("arrays") is not None:
        _check_tree(doc["optimizer"]["arrays"], arrays, used, [])
    if len(used) != len(set(used)) or set(used) != set(arrays):
        raise ValueError(f"the arrays {sorted(set(arrays) - set(used))} are named by no state, or one is named twice")
    return Checkpoint(doc, tree, arrays, shapes)


def _generic(name: str) -> str:
    """A parameter name without Gluon's per-process block counters (``dense3_weight`` ->
    ``dense#_weight``): two builds of one model in one process differ only there."""
    return re.sub(r"\d+", "#", name)


def _natural(name: str) -> List[Any]:
    """``name``'s sort key with its numbers compared as numbers (``dense9`` before ``dense10``)."""
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", name)]


def _matches(saved: Sequence[Any], now: Tuple[str, Tuple[int, ...], str]) -> bool:
    sname, sshape, sdtype = saved
    name, shape, dtype = now
    return tuple(sshape) == tuple(shape) and sdtype == dtype and _generic(sname) == _generic(name)


def _in_build_order(saved: Sequence[Sequence[Any]],
                    params: List[Tuple[str, Tuple[int, ...], str]]) -> Optional[Dict[int, int]]:
    """Saved index -> this trainer's index, pairing the parameters in the order their blocks
    were built; None where that pairing does not match either.

    MXNet 1.9.1's ``Trainer`` numbers parameters by their names sorted as strings, and a
    block's name carries Gluon's per-process counter: the same model built when the counter
    stood at 8 (``dense8``, ``dense9``) and at 9 (``dense9``, ``dense10``, which sorts first)
    numbers its layers in opposite orders. The counters rise as blocks are built, so names
    sorted with their numbers as numbers list the parameters in build order in both."""
    before = sorted(range(len(saved)), key=lambda i: _natural(saved[i][0]))
    now = sorted(range(len(params)), key=lambda i: _natural(params[i][0]))
    if not all(_matches(saved[a], params[b]) for a, b in zip(before, now)):
        return None
    return dict(zip(before, now))


def check_params(ck: Checkpoint, path: str, params: List[Tuple[str, Tuple[int, ...], str]],
                 owner: str = "trainer", per_index: int = 1, build_order: bool = False) -> Optional[Dict[int, int]]:
    """The checkpoint's state tree fits ``params`` ((name, shape, dtype) in the order of the
    optimizer's indices; ``per_index`` indices per parameter, a Module's devices):
    CheckpointError naming the first difference. Files written before the parameters were
    recorded are checked by the shapes of their state arrays (each its weight's, as every
    optimizer of MXNet 1.9.1 but GroupAdaGrad keeps them).

    ``build_order``: the indices follow the names sorted as strings (a Gluon ``Trainer``'s),
    so parameters pair in the order their blocks were built (:func:`_in_build_order`); else
    index by index (a Module's indices are its symbol's arguments, in order). Returns None
    where the saved indices are this owner's, else saved index -> index."""
    saved = ck.meta.get("params")
    moved: Optional[Dict[int, int]] = None
    if saved is not None:
        if len(saved) != len(params):
            raise CheckpointError(f"{path!r} holds the state of {len(saved)} parameters; this {owner} has "
                                  f"{len(params)}: it was saved for another model")
        moved = _in_build_order(saved, params) if build_order else None
        if moved is None:
            pairs = [(s, p) for s, p in zip(saved, params) if not _matches(s, p)]
            if build_order and not pairs:  # in index order they match, in build order they do not
                raise CheckpointError(
                    f"{path!r} was saved for another model: its parameters, in the order their blocks were "
                    f"built ({', '.join(sorted((s[0] for s in saved), key=_natural))}), do not pair with this "
                    f"{owner}'s ({', '.join(sorted((p[0] for p in params), key=_natural))})")
            if pairs:
                (sname, sshape, sdtype), (name, shape, dtype) = pairs[0]
                raise CheckpointError(
                    f"{path!r} was saved for another model: its parameter {sname!r} {tuple(sshape)} {sdtype} "
                    f"stands where this {owner} has {name!r} {tuple(shape)} {dtype}")
        if moved is not None and all(a == b for a, b in moved.items()):
            moved = None
    for index, shapes in ck.shapes.items():
        i = index // per_index if index >= 0 else -1
        if moved is not None and i in moved:
            i = moved[i]
        if not 0 <= i < len(params):
            raise CheckpointError(f"{path!r} holds optimizer state for parameter index {index}; this {owner} "
                                  f"has {len(params)} parameters: it was saved for another model")
        for shape in shapes if saved is None else ():  # the parameters recorded were checked above: a
            # state need not have its weight's shape (GroupAdaGrad's history is one value per row)
            if tuple(shape) != tuple(params[i][1]):
                raise CheckpointError(f"{path!r} holds optimizer state of shape {tuple(shape)} for parameter "
                                      f"{params[i][0]!r}, whose shape is {tuple(params[i][1])}: it was saved for "
                                      "another model")
    return moved


def reindexed(states: Dict[Any, Any], moved: Optional[Dict[int, int]]) -> Dict[Any, Any]:
    """An updater's ``states`` with the saved indices replaced as :func:`check_params` said."""
    if moved is None:
        return states
    return {moved.get(k, k) if isinstance(k, int) else k: v for k, v in states.items()}


# -- loading: all or nothing ---------------------------------------------------------------

def checked_scaler_state(scaler: Any, saved: Any, fname: str) -> Dict[str, Any]:
    """What ``scaler`` holds once ``saved`` (a state_dict from a file) is loaded, checked; its
    attachments kept. ``CheckpointError`` naming the file and the bad value."""
    try:
        fresh = scaler.checked(saved)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{fname!r}: its loss scaler state cannot be loaded: {exc}") from None
    fresh._stages, fresh._steps, fresh._abandoned, fresh._round_finite, fresh._round_scaled = (
        scaler._stages, scaler._steps, scaler._abandoned, scaler._round_finite, scaler._round_scaled)
    return dict(vars(fresh))


class Undo:
    """What a load changes, as it was: put back on any exception (a Ctrl-C included)."""

    def __init__(self, opt: Any, scaler: Any, updaters: Any) -> None:
        self.opt, self.scaler, self.updaters = opt, scaler, updaters
        sched = getattr(opt, "lr_scheduler", None)
        self.vars = [(o, dict(vars(o))) for o in (opt, sched, scaler) if o is not None]

    def __call__(self, trainer: Any) -> None:
        for obj, saved in self.vars:
            for key in set(vars(obj)) - set(saved):
                del vars(obj)[key]
            vars(obj).update(saved)
        mxi.restore_updaters(trainer, self.updaters)


class _NoGlobals(pickle.Unpickler):
    """Reads plain containers, strings, bytes and numbers; refuses every class or function."""

    def find_class(self, module: str, name: str) -> Any:
        raise CheckpointError(f"refused to load {module}.{name} from the file: a gluon_amp checkpoint "
                              "contains no code or classes")


def _not_ours(path: str) -> str:
    """Why a non-zip file is refused, read without running anything from it."""
    old, why = _peek(path)
    if old is not None:
        return (f"{path!r} was written by an older gluon_amp as a pickle, which can run code when loaded. "
                "If you trust it, load it with gluon_amp.load_states(trainer, fname, trusted=True), or "
                "convert it once: python -m gluon_amp.training.checkpoint upgrade OLD NEW.")
    return why


def _peek(path: str) -> Tuple[Optional[Dict[str, Any]], str]:
    """The outer dictionary of an old (pickle) checkpoint, read without running anything (it
    holds plain values; MXNet's optimizer blob inside stays bytes), or None and why not."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] != b"\x80":
        return None, f"{path!r} is not a gluon_amp.save_states file"
    try:
        with open(path, "rb") as f:
            old = _NoGlobals(f).load()
    except CheckpointError as exc:
        return None, (f"{path!r} is not a gluon_amp checkpoint: its pickle names a class ({exc}). A plain "
                      "Trainer.save_states file loads with trainer.load_states(fname); like any pickle, only "
                      "load files you trust.")
    except Exception as exc:  # noqa: BLE001  a truncated or corrupt pickle
        return None, f"{path!r} is not a gluon_amp.save_states file ({exc})"
    if isinstance(old, dict) and old.get("format") == OLD_FORMAT:
        return old, ""
    return None, f"{path!r} is not a gluon_amp.save_states file"


def read_old(path: str) -> Tuple[Dict[str, Any], Dict[Any, Any], Any]:
    """``(scaler state, optimizer states, optimizer)`` of an old pickle checkpoint. Runs
    pickle: only for files the caller trusts."""
    if zipfile.is_zipfile(path):
        raise CheckpointError(f"{path!r} is a checkpoint in the current format already: load it with "
                              "gluon_amp.load_states(trainer, fname), without trusted=True; there is nothing "
                              "to upgrade")
    old, why = _peek(path)  # the outer dictionary: plain values, read without running anything
    if old is None:
        raise CheckpointError(why)
    if not isinstance(old.get("trainer"), bytes) or not isinstance(old.get("scaler"), dict):
        raise CheckpointError(f"{path!r} is an old gluon_amp checkpoint without its trainer or scaler part; "
                              "the file is damaged")
    try:
        states = _MovedModules(io.BytesIO(old["trainer"])).load()  # MXNet's own blob, trusted
    except Exception as exc:  # noqa: BLE001  what a damaged blob raises, whichever
        raise CheckpointError(f"{path!r}: the optimizer states inside cannot be read ({type(exc).__name__}: "
                              f"{exc}); the file is damaged") from exc
    states, opt = states if isinstance(states, tuple) and len(states) == 2 else (states, None)
    return old["scaler"], states, opt


class _MovedModules(pickle.Unpickler):
    """Unpickles what older gluon_amp versions pickled, at the modules their classes live in now."""

    MOVED = {"gluon_amp.master_weights": "gluon_amp.training.master_weights"}

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(self.MOVED.get(module, module), name)


def upgrade(old_path: str, new_path: str) -> None:
    """Rewrite a trusted old (pickle) checkpoint in the current format."""
    scaler, states, opt = read_old(old_path)
    if opt is None:
        raise CheckpointError(f"{old_path!r} holds no optimizer (saved without dump_optimizer); re-save it "
                              "from a trainer with gluon_amp.save_states")
    # the mode an old file did not record, where its states tell it: float32 master copies (O2)
    master = any(isinstance(v, MasterState) for v in (states.values() if isinstance(states, dict) else ()))
    mode = {"master_weights": {"dtype": "low-precision weights", "keep_master": True}} if master else None
    write(new_path, {"scaler": scaler, "mode": mode}, states, opt)


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

