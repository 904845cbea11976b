"""bfloat16 executes on a native host (simulated on every CPU; real where oneDNN has bf16 kernels):
numerics against float32."""
import numpy as np
import mxnet as mx
from mxnet import autograd

import gluon_amp
from helpers import import_gluoncv
from helpers import make_net


def _run(net, x):
    with autograd.record():
        out = net(x)
        loss = out.sum()
    loss.backward()
    grads = [p.grad().asnumpy() for p in net.collect_params().values() if p.grad_req != "null"]
    return out.asnumpy(), grads


def test_mixed_net_forward_backward_within_bf16_tolerance(native_host):
    x = mx.nd.random.uniform(-1, 1, shape=(4, 3, 8, 8))
    ref_out, ref_grads = _run(make_net(seed=1), x)
    with gluon_amp.autocast("bfloat16"):
        net = make_net(seed=1)
        out, grads = _run(net, x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, rtol=3e-2, atol=3e-3)
    assert len(grads) == len(ref_grads) == 8
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == np.float32, i  # master weights and their gradients stay fp32
        assert np.linalg.norm(g - r) <= 0.05 * np.linalg.norm(r) + 1e-4, i


def test_ssd512_hybridized_train_and_predict_bf16(native_host):
    import_gluoncv()
    from gluoncv.model_zoo import get_model
    x = mx.nd.random.uniform(-1, 1, shape=(1, 3, 512, 512))

    def build():
        mx.random.seed(7)
        net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False,
                        norm_layer=mx.gluon.nn.BatchNorm)
        net.initialize()
        net.hybridize(static_alloc=True, static_shape=True)
        return net

    ref = build()
    with autograd.train_mode():
        ref_cls, ref_box = [o.asnumpy() for o in ref(x)[:2]]  # static_alloc reuses outputs
    ref_scores = ref(x)[1].asnumpy()
    with gluon_amp.autocast("bfloat16"):
        net = build()
        with autograd.record():
            cls_pred, box_pred, _ = net(x)
            loss = cls_pred.sum() + box_pred.sum()
        loss.backward()
        assert np.isfinite(loss.asscalar())
        # 50+ random-init layers in bfloat16 drift ~34% in L2 from float32 (the peer's
        # bf16 gives the same 0.3406 on this seed), so compare direction, not distance.
        for got, want in ((cls_pred, ref_cls), (box_pred, ref_box)):
            got = got.asnumpy().ravel()
            want = want.ravel()
            assert got.dtype == np.float32
            cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
            assert cosine > 0.9, cosine
        first_conv = [p for n, p in net.collect_params().items() if n.endswith("conv0_weight")][0]
        grad = first_conv.grad()
        assert grad.dtype == np.float32 and np.isfinite(grad.asnumpy()).all()
        ids, scores, boxes = net(x)   # predict mode, same cached op family
        assert scores.shape == ref_scores.shape
        assert np.isfinite(boxes.asnumpy()).all()
