"""``mxnet_internals.versions``: the count of writes MXNet keeps per array, read from memory at
the 1.9.1 wheel's offsets, checked at first use."""
import mxnet as mx
import numpy as np

from gluon_amp.mxnet_internals import versions


def test_this_build_reads_the_counts():
    assert versions.readable()


def test_every_kind_of_write_moves_the_count_by_one_and_only_its_arrays():
    """Operators, ``out=``, item and slice assignment, NumPy values, copies into it, and writes
    through a view (which shares the array's memory) each move it by one; another array's
    count stays."""
    a, other = mx.nd.zeros((4, 5)), mx.nd.ones((3,))
    writes = [lambda: a.__setitem__(slice(None), 1.0), lambda: a.__iadd__(1),
              lambda: mx.nd.elemwise_add(a, a, out=a), lambda: a.__setitem__((1, 2), 7.0),
              lambda: a.__setitem__(slice(None), np.ones((4, 5))), lambda: mx.nd.ones((4, 5)).copyto(a),
              lambda: a.reshape((20,)).__setitem__(slice(0, 3), 2.0), lambda: a[1].__setitem__(slice(None), 3.0)]
    start, kept = versions.write_count(a), versions.write_count(other)
    for k, write in enumerate(writes, 1):
        write()
        assert versions.write_count(a) == start + k, k
    assert versions.write_count(other) == kept
    a.asnumpy(), a.wait_to_read()  # reads move nothing
    assert versions.write_count(a) == start + len(writes)


def test_the_count_waits_for_writes_already_pushed():
    """A write still queued in MXNet's engine counts: the count is read once it completed."""
    a = mx.nd.zeros((512, 512))
    start = versions.write_count(a)
    for _ in range(20):
        mx.nd.dot(a, a, out=a)  # queued, not waited for
    assert versions.write_count(a) == start + 20
