"""Promises of the multi-tensor engine's core that its callers lean on: a kept sweep
rebound to new tensors takes only tensors of the dtypes and sizes it was planned for,
and written tensors that lie apart (side by side in one buffer) but not ones that
overlap by part of a tensor; the shared-memory check judges a strided view up to its
last element and a gradient swept through a copy by its own memory; a source that ends
where its own destination begins is read in place; ``layout_key`` tells apart tensors
at one address of another size or dtype; ``borrowed`` keeps identity and aliases;
``zero_grads_`` detaches as torch's ``zero_grad`` does; a kept clip sweep reads the
same gradients on a second call; the CPU step's kept scratch follows a parameter cut
down; every empty parameter counts its step.

Run on both CPU-side paths (conftest's ``path``) where both take the call; tensors tiny.
"""
import pytest
import torch

from tritamp.kernels.adam import adam_step
from tritamp.kernels.check_unscale import check_unscale_launch, check_unscale_prepare
from tritamp.kernels.engine import (SharedMemoryError, borrowed, layout_key, refuse_shared_rows,
                                    zero_grads_)
from tritamp.kernels.larc import larc_rescale
from tritamp.kernels.sgd import sgd_launch, sgd_prepare
from tritamp.optimizers import FusedSGD, clip_grad_norm_

SCALE = torch.tensor(4.0)
ADAM = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_a_kept_sweep_refuses_gradients_of_another_size_or_dtype(path):
    params = [torch.zeros(4), torch.zeros(8)]
    prepared = sgd_prepare(params, [torch.ones(4), torch.ones(8)])
    assert prepared.rebindable
    assert not prepared.rebind("grads", [torch.ones(4), torch.ones(6)])
    assert not prepared.rebind("grads", [torch.ones(4), torch.ones(8, dtype=torch.float16)])
    grads = [torch.full((4,), 2.0), torch.full((8,), 4.0)]  # (kept alive: see rebind)
    assert prepared.rebind("grads", grads)
    sgd_launch(prepared, lr=0.5)
    assert params[0].tolist() == [-1.0] * 4 and params[1].tolist() == [-2.0] * 8


def test_destinations_side_by_side_in_one_buffer_rebind_and_run(path):
    srcs, dsts = [torch.ones(4), torch.ones(4)], [torch.zeros(4), torch.zeros(4)]
    kept = check_unscale_prepare(srcs, dsts=dsts)
    assert kept.rebindable_writes
    flat = torch.zeros(8)
    srcs = [torch.full((4,), 8.0), torch.full((4,), 4.0)]
    assert kept.rebind_lists(srcs, [flat[:4], flat[4:]])  # spans touch, no byte in common
    check_unscale_launch(kept, SCALE, None)
    assert flat.tolist() == [2.0] * 4 + [1.0] * 4


def test_a_rebind_to_destinations_overlapping_by_part_of_a_tensor_is_not_taken(path):
    srcs, dsts = [torch.ones(4), torch.ones(4)], [torch.zeros(4), torch.zeros(4)]
    kept = check_unscale_prepare(srcs, dsts=dsts)
    flat = torch.zeros(8)
    # the second starts 8 bytes into the first's 16: two elements in common
    assert not kept.rebind_lists(srcs, [flat[:4], flat[2:6]])
    assert not kept.rebind_lists(srcs, [flat[3:7], flat[:4]])
    assert kept.rebind_lists(srcs, [flat[4:], flat[:4]])


def test_a_source_that_ends_where_its_own_destination_begins_is_read_in_place(path):
    buf = torch.arange(8.0)
    kept = check_unscale_prepare([buf[:4]], dsts=[buf[4:]])
    # the spans touch, no byte in common: no read copy, so the sweep stays rebindable
    assert kept.rebindable_writes
    check_unscale_launch(kept, SCALE, None)
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.25, 0.5, 0.75]


def test_a_strided_view_is_judged_up_to_its_last_element():
    w = torch.zeros(8)
    # every other element ends at w[6]: a tensor starting there shares it, one after not
    with pytest.raises(SharedMemoryError, match=r"outs\[0\] and outs\[1\] share memory"):
        refuse_shared_rows("t", [("outs", [w[::2], w[6:]], True)])
    refuse_shared_rows("t", [("outs", [w[::2], w[7:]], True)])


def test_a_gradient_swept_through_a_copy_is_judged_by_its_own_memory(path):
    # larc_rescale writes its gradients: a transposed one goes through a dense copy in
    # its parameter's layout, but the write lands in the caller's memory
    base = torch.ones(4, 4)
    params = [torch.ones(4, 4), torch.ones(4, 4)]
    with pytest.raises(SharedMemoryError, match=r"larc_rescale: grads\[0\] and grads\[1\]"):
        larc_rescale(params, [base.t(), base], torch.ones(2))
    assert torch.equal(base, torch.ones(4, 4))


def test_layout_key_tells_apart_tensors_at_one_address_of_another_size_or_dtype():
    t = torch.zeros(8)
    addresses, layout = layout_key([t])
    for other in (t[:4], t.view(torch.int32)):  # same address and strides
        assert layout_key([other])[0] == addresses
        assert layout_key([other])[1] != layout
        assert layout_key([other, None])[1] != layout_key([t, None])[1]


def test_borrowed_keeps_identity_between_lists_and_aliases_the_memory():
    a, b = torch.arange(4.0), torch.arange(6.0)[2:]
    lent = borrowed([a, None, b, a])
    assert lent[1] is None and lent[0] is lent[3] and lent[0] is not lent[2]
    assert lent[2].data_ptr() == b.data_ptr() and torch.equal(lent[2], b)
    a.add_(1.0)
    assert torch.equal(lent[0], a)


def test_zero_grads_detaches_and_zeroes_as_torch_zero_grad_does():
    w = torch.ones(3, requires_grad=True)
    leaf = torch.full((3,), 2.0, requires_grad=True)  # a gradient that requires grad
    made = w * 3  # a gradient with a graph (create_graph=True)
    zero_grads_([leaf, made])
    assert not leaf.requires_grad and made.grad_fn is None and not made.requires_grad
    assert leaf.tolist() == [0.0] * 3 and made.tolist() == [0.0] * 3


def test_clipping_the_same_gradients_twice_reads_them_both_times(path):
    # the second call finds its kept sweeps at the gradients' own addresses
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    params[0].grad, params[1].grad = torch.full((4,), 3.0), torch.full((4,), 4.0)
    for want_total in (10.0, 2.0):
        total = clip_grad_norm_(params, 2.0)
        torch.testing.assert_close(total, torch.tensor(want_total), rtol=1e-5, atol=0)
        torch.testing.assert_close(params[0].grad, torch.full((4,), 0.6), rtol=1e-5, atol=0)
        torch.testing.assert_close(params[1].grad, torch.full((4,), 0.8), rtol=1e-5, atol=0)


def test_a_half_parameter_cut_down_between_steps_is_stepped_at_its_new_size(cpu_path):
    # the CPU step's fp32 scratch is kept across the sweep's rebuilds: a parameter of a
    # new size gets scratch of its size
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt = FusedSGD([p], lr=0.125)
    p.grad = torch.ones(8, dtype=torch.float16)
    opt.step()
    p.data = p.data[:4].clone()
    p.grad = torch.ones(4, dtype=torch.float16)
    opt.step()
    assert p.shape == (4,) and p.tolist() == [0.75] * 4


@pytest.mark.parametrize("found_inf, want", [(0.0, 1.0), (1.0, 0.0)])
def test_every_empty_parameter_counts_its_step_unless_the_step_is_skipped(path, found_inf,
                                                                          want):
    sizes = (0, 4, 0, 0)
    steps = [torch.zeros(()) for _ in sizes]
    adam_step([torch.ones(n) for n in sizes], [torch.ones(n) for n in sizes],
              [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], steps,
              **ADAM, found_inf=torch.tensor(found_inf))
    assert [s.item() for s in steps] == [want] * 4
