"""The ops of real model graphs (GluonCV's model zoo, MXNet's vision zoo, GluonNLP's BERT and
language models, gluoncv2's families where it is installed): each net is built offline with random
weights and traced symbolically (``net(mx.sym.var(...))``), so nothing runs; the harness checks each
op is covered."""
from __future__ import annotations

import contextlib
import inspect
import json
import warnings
from typing import Any, Callable, Dict, List, Tuple

import mxnet as mx

from ..mxnet_internals import cached_graph, registry


def _quiet() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _ops_of(sym: Any) -> List[str]:
    infos = registry.op_infos()
    ops = {n["op"] for n in json.loads(sym.tojson())["nodes"] if n["op"] != "null"}
    return sorted(infos[o].canonical if o in infos else o for o in ops)


def _trace(net: Any, inputs: Tuple[str, ...] = ("data",)) -> List[str]:
    out = net(*[mx.sym.var(n) for n in inputs])
    if isinstance(out, (list, tuple)):
        flat: List[Any] = []
        stack = list(out)
        while stack:
            o = stack.pop()
            if isinstance(o, (list, tuple)):
                stack.extend(o)
            else:
                flat.append(o)
        out = mx.sym.Group(flat)
    return _ops_of(out)


def _gluoncv(name: str) -> Any:
    from gluoncv.model_zoo import model_zoo
    fn = model_zoo._models[name.lower()]
    params = inspect.signature(fn).parameters
    kwargs: Dict[str, Any] = {"pretrained": False}
    for key, value in (("pretrained_base", False), ("use_kinetics_pretrain", False)):
        if key in params:
            kwargs[key] = value
    if "pretrained_base" not in kwargs and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        try:
            return fn(pretrained_base=False, **kwargs)
        except (TypeError, Warning):
            pass
    return fn(**kwargs)


def _gluonnlp() -> Dict[str, Callable[[], List[str]]]:
    import gluonnlp as nlp
    vocab = nlp.Vocab(nlp.data.count_tokens("a b c d e f g h".split()))

    def bert() -> List[str]:
        model, _ = nlp.model.bert.get_bert_model(
            "bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False, use_pooler=True,
            use_decoder=True, use_classifier=True, hparam_allow_override=True, num_layers=2, units=32,
            embed_size=32, hidden_size=64, num_heads=4, max_length=32, dropout=0.1)
        return _trace(model, ("tokens", "segments", "valid_length", "masked_positions"))

    def lm(name: str) -> Callable[[], List[str]]:
        def build() -> List[str]:
            net, _ = nlp.model.get_model(name, dataset_name=None, vocab=vocab, pretrained=False)
            net.initialize()
            net.hybridize()
            net(mx.nd.ones((5, 2)), net.begin_state(batch_size=2))
            return _ops_of(cached_graph(net, "conformance")[1])
        return build

    def transformer() -> List[str]:
        enc, dec, step = nlp.model.transformer.get_transformer_encoder_decoder(
            num_layers=2, units=32, hidden_size=64, num_heads=4, max_src_length=16, max_tgt_length=16)
        enc.initialize()
        enc.hybridize()
        enc(mx.nd.ones((2, 5, 32)), None, mx.nd.array([5, 3]))
        ops = set(_ops_of(cached_graph(enc, "conformance")[1]))
        del dec, step
        return sorted(ops)

    return {"gluonnlp:bert": bert, "gluonnlp:standard_lstm_lm_200": lm("standard_lstm_lm_200"),
            "gluonnlp:awd_lstm_lm_600": lm("awd_lstm_lm_600"), "gluonnlp:transformer": transformer}


def _gluoncv2() -> Dict[str, Callable[[], List[str]]]:
    """One net per family of gluoncv2's model provider (the first name of each), when it is installed
    (``pip install --no-deps gluoncv2``; its graphs use the same MXNet ops)."""
    try:
        import re

        from gluoncv2.model_provider import _models, get_model
    except ImportError:
        return {}
    families: Dict[str, str] = {}
    for name in sorted(_models):
        families.setdefault(re.split(r"[\d_]", name)[0], name)
    return {f"gluoncv2:{n}": (lambda n=n: _trace(get_model(n, pretrained=False))) for n in families.values()}


def model_ops(limit: int = 0) -> Tuple[Dict[str, List[str]], Dict[str, str]]:
    """``({model: its canonical ops}, {model: why it was not traced})`` over GluonCV's zoo
    (``limit``: its first so many, 0 for all), MXNet's vision zoo and GluonNLP's models."""
    import gluoncv
    from mxnet.gluon.model_zoo import vision
    found: Dict[str, List[str]] = {}
    failed: Dict[str, str] = {}
    builders: Dict[str, Callable[[], List[str]]] = {}
    names = list(gluoncv.model_zoo.get_model_list())
    for name in names[:limit] if limit else names:
        builders[f"gluoncv:{name}"] = (lambda n=name: _trace(_gluoncv(n)))
    for name in ("resnet18_v1", "mobilenet1.0", "densenet121", "squeezenet1.0", "inceptionv3", "vgg11_bn"):
        builders[f"vision:{name}"] = (lambda n=name: _trace(vision.get_model(n, pretrained=False)))
    builders.update(_gluonnlp())
    builders.update(_gluoncv2())
    for model, build in builders.items():
        try:
            with _quiet():
                found[model] = build()
        except Exception as e:  # noqa: BLE001  a net that does not build offline: named, not fatal
            failed[model] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return found, failed
