"""Rows of a multi-tensor sweep that share memory where one of them is written.

A sweep's rows run concurrently on a GPU, so a tensor one row writes and another row reads
or writes would give a result that depends on their order (and the interpreted kernels,
the production CPU path and the reference disagreed). Every sweep that writes refuses
such rows before anything is written, naming both tensors; disjoint views of one buffer,
interleaved strided views and tensors shared by rows that only read them are accepted.
A kept sweep rebound to new tensors that share memory goes back to the refusal. Within one
row, a source shifted against its own destination is read as it was given (the reference's
values) on both paths, and an optimizer sweep refuses a row's tensors that share memory
where one is written (a gradient that is its parameter aside).
"""
import pytest
import torch

from tritamp import amp
from tritamp.kernels.adam import adam_step
from tritamp.kernels.axpby import multi_tensor_axpby, multi_tensor_scale
from tritamp.kernels.check_unscale import (check_unscale, check_unscale_launch,
                                           check_unscale_prepare, check_unscale_ref)
from tritamp.kernels.engine import SharedMemoryError, refuse_shared_rows, row_labels
from tritamp.kernels.larc import larc_rescale
from tritamp.optimizers import FusedAdam, FusedSGD

SCALE = torch.tensor(4.0)


def _snapshot(*tensors):
    return [t.clone() for t in tensors]


def _unchanged(before, *tensors):
    return all(torch.equal(b, t) for b, t in zip(before, tensors))


def test_destinations_that_overlap_across_rows_are_refused_before_anything_is_written(path):
    buf = torch.arange(8.0)
    dsts = [buf[:4], buf[2:6]]
    found = torch.zeros(())
    before = _snapshot(buf, found)
    with pytest.raises(SharedMemoryError, match=r"check_unscale: dsts\[0\] and dsts\[1\] share "
                       r"memory.*Nothing was written.*dsts\[1\]\.clone\(\)"):
        check_unscale([torch.ones(4), torch.full((4,), float("inf"))], SCALE, found, dsts=dsts)
    assert _unchanged(before, buf, found)


def test_an_addend_or_source_that_is_another_rows_destination_is_refused(path):
    s = [torch.full((4,), 4.0), torch.full((4,), 8.0)]
    d = [torch.full((4,), 1.0), torch.full((4,), 2.0)]
    before = _snapshot(*d)
    with pytest.raises(SharedMemoryError, match=r"dsts\[0\] and adds\[1\] share memory, and the "
                       r"sweep writes dsts\[0\]"):
        check_unscale(s, SCALE, None, dsts=d, adds=[torch.zeros(4), d[0]])
    with pytest.raises(SharedMemoryError, match=r"dsts\[0\] and srcs\[1\] share memory"):
        check_unscale([s[0], d[0]], SCALE, None, dsts=d)
    assert _unchanged(before, *d)


def test_one_tensor_unscaled_in_place_in_two_rows_is_refused(path):
    g = torch.full((4,), 8.0)
    with pytest.raises(SharedMemoryError, match=r"srcs\[0\] and srcs\[1\] share memory"):
        check_unscale([g, g], SCALE, torch.zeros(()))
    assert torch.equal(g, torch.full((4,), 8.0))  # (not divided twice)


def test_rows_apart_in_one_buffer_are_accepted_and_match_the_reference(path):
    # adjacent slices of one flat buffer, and interleaved columns of one matrix: spans
    # that touch or interleave, no element in common
    flat, flat_ref = torch.zeros(8), torch.zeros(8)
    srcs = [torch.arange(4.0), torch.arange(4.0, 8.0)]
    check_unscale(srcs, SCALE, None, dsts=[flat[:4], flat[4:]])
    check_unscale_ref(srcs, SCALE, None, dsts=[flat_ref[:4], flat_ref[4:]])
    assert torch.equal(flat, flat_ref) and torch.equal(flat, torch.arange(8.0) / 4)
    w = torch.zeros(3, 4)
    srcs = [torch.full((3, 2), 4.0), torch.full((3, 2), 8.0)]
    check_unscale(srcs, SCALE, None, dsts=[w[:, 0::2], w[:, 1::2]])
    assert torch.equal(w, torch.tensor([[1.0, 2.0] * 2] * 3))


def test_rows_that_only_read_a_shared_tensor_are_accepted(path):
    g = torch.full((4,), 8.0)
    d = [torch.zeros(4), torch.zeros(4)]
    check_unscale([g, g], SCALE, None, dsts=d)  # one source read by two rows
    assert torch.equal(d[0], torch.full((4,), 2.0)) and torch.equal(d[1], d[0])
    found = torch.zeros(())
    check_unscale([g, g], None, found, write=False)  # a check-only sweep writes nothing
    assert found.item() == 0.0


def test_axpby_and_scale_refuse_outputs_shared_across_rows(path):
    out = torch.zeros(6)
    x = [torch.ones(4), torch.ones(4)]
    with pytest.raises(SharedMemoryError, match=r"multi_tensor_axpby: outs\[0\] and outs\[1\]"):
        multi_tensor_axpby(x, x, [out[:4], out[2:]], 1.0, 1.0, torch.zeros(1, dtype=torch.int))
    with pytest.raises(SharedMemoryError, match=r"multi_tensor_scale: dsts\[0\] and srcs\[1\]"):
        multi_tensor_scale([x[0], out[:4]], [out[:4], torch.zeros(4)], 2.0,
                           torch.zeros(1, dtype=torch.int))
    assert torch.equal(out, torch.zeros(6))


def test_optimizer_and_larc_sweeps_refuse_state_or_gradients_shared_across_rows(path):
    params = [torch.zeros(4), torch.zeros(4)]
    grads = [torch.ones(4), torch.ones(4)]
    shared = torch.zeros(4)
    steps = [torch.zeros(()), torch.zeros(())]
    before = _snapshot(*params, shared)
    with row_labels(["first", "second"]):
        with pytest.raises(SharedMemoryError, match=r"adam_step: exp_avgs\[0\] \(first\) and "
                           r"exp_avgs\[1\] \(second\) share memory"):
            adam_step(params, grads, [shared, shared], [torch.zeros(4), torch.zeros(4)],
                      steps, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert _unchanged(before, *params, shared) and all(s.item() == 0 for s in steps)
    g = torch.ones(6)
    with pytest.raises(SharedMemoryError, match=r"larc_rescale: grads\[0\] and grads\[1\]"):
        larc_rescale(params, [g[:4], g[2:]], torch.ones(2))
    assert torch.equal(g, torch.ones(6))


def test_a_kept_sweep_rebound_to_tensors_that_share_memory_goes_back_to_the_refusal(path):
    a, b = torch.full((4,), 8.0), torch.full((4,), 8.0)
    prepared = check_unscale_prepare([a, b])
    assert prepared.rebindable_in_place
    c = torch.full((4,), 8.0)
    assert not prepared.rebind_sources([c, c])  # (preparing again refuses them by name)
    d, e = torch.full((4,), 8.0), torch.full((4,), 8.0)
    assert prepared.rebind_sources([d, e])
    check_unscale_launch(prepared, SCALE, torch.zeros(()))
    assert torch.equal(d, torch.full((4,), 2.0)) and torch.equal(e, d)
    assert torch.equal(c, torch.full((4,), 8.0))
    # destinations and addends: an addend that is another row's destination
    srcs, dsts = [torch.ones(4), torch.ones(4)], [torch.zeros(4), torch.zeros(4)]
    kept = check_unscale_prepare(srcs, dsts=dsts, adds=[torch.zeros(4), torch.zeros(4)])
    assert kept.rebindable_writes
    assert not kept.rebind_lists(srcs, dsts, adds=[dsts[1], torch.zeros(4)])
    assert kept.rebind_lists(srcs, dsts, adds=[dsts[0], dsts[1]])  # (each its own row's)
    # a row unscaled in place beside one that is not, with addends: rows apart rebind
    # and run; an addend at the other row's destination goes back to the refusal
    a, b, d = torch.full((4,), 8.0), torch.full((4,), 8.0), torch.zeros(4)
    kept = check_unscale_prepare([a, b], dsts=[a, d], adds=[torch.zeros(4), torch.zeros(4)])
    # (a rebound sweep holds no tensor on the Triton path: the caller keeps them alive)
    a, b, d, one = torch.full((4,), 8.0), torch.full((4,), 8.0), torch.zeros(4), torch.ones(4)
    assert kept.rebindable_writes and kept.rebind_lists([a, b], [a, d], adds=[a, one])
    check_unscale_launch(kept, SCALE, None)
    assert a.tolist() == [10.0] * 4 and d.tolist() == [3.0] * 4  # (8 / 4 + 8; 8 / 4 + 1)
    assert not kept.rebind_lists([a, b], [a, d], adds=[d, one])


def test_strided_views_are_judged_element_by_element():
    w = torch.zeros(4, 6)
    # every other column, and the columns between: spans overlap, elements do not
    refuse_shared_rows("t", [("outs", [w[:, 0::2], w[:, 1::2]], True)])
    with pytest.raises(SharedMemoryError):  # every other column and every third meet
        refuse_shared_rows("t", [("outs", [w[:, 0::2], w[:, 0::3]], True)])
    # a tensor viewed as another dtype still shares its bytes
    with pytest.raises(SharedMemoryError, match=r"outs\[0\] and ins\[1\]"):
        refuse_shared_rows("t", [("outs", [w[0], torch.zeros(6)], True),
                                 ("ins", [torch.zeros(6), w[0].view(torch.int32)], False)])
    # the same row may share memory with itself (an in-place update)
    refuse_shared_rows("t", [("outs", [w[0], w[1]], True), ("ins", [w[0], w[1]], False)])


def test_amp_refuses_one_gradient_given_to_two_parameters_by_name(cpu_path):
    """Before the check, amp's steady-state unscale (a kept sweep rebound to the step's
    gradients) divided the shared gradient by the loss scale twice on a CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = FusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, loss_scale=8.0)
    x = torch.randn(2, 4)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as loss:
            loss.backward()
        opt.step()
    opt.zero_grad()
    weights = _snapshot(*model.parameters())
    with pytest.raises(SharedMemoryError, match=r"amp: gradients\[1\] \(0\.bias\) and "
                       r"gradients\[3\] \(1\.bias\) share memory"):
        with amp.scale_loss(model(x).float().sum(), opt) as loss:
            loss.backward()
            model[1].bias.grad = model[0].bias.grad
            shared = model[0].bias.grad.clone()
    assert torch.equal(model[0].bias.grad, shared)  # still scaled, not divided twice
    assert _unchanged(weights, *model.parameters())
    # the next step, with gradients of their own, runs
    model[1].bias.grad = None
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt) as loss:
        loss.backward()
    opt.step()
    assert not _unchanged(weights, *model.parameters())


N_SHIFTED = 5000  # (more than one block of the kernels: a later block reads what an
#                   earlier one wrote if the source is not read through a copy)


def test_a_source_or_addend_shifted_against_its_own_destination_reads_the_values_given(path):
    want = torch.arange(N_SHIFTED + 1.0)
    check_unscale_ref([want[:-1]], SCALE, None, dsts=[want[1:]])
    buf = torch.arange(N_SHIFTED + 1.0)
    found = torch.zeros(())
    check_unscale([buf[:-1]], SCALE, found, dsts=[buf[1:]])
    assert torch.equal(buf, want) and found.item() == 0.0
    src = torch.full((N_SHIFTED,), 8.0)
    want = torch.arange(N_SHIFTED + 1.0)
    check_unscale_ref([src], SCALE, None, dsts=[want[1:]], adds=[want[:-1]])
    buf = torch.arange(N_SHIFTED + 1.0)
    check_unscale([src], SCALE, None, dsts=[buf[1:]], adds=[buf[:-1]])
    assert torch.equal(buf, want)


def test_axpby_with_an_input_shifted_against_its_output_reads_the_values_given(path):
    buf = torch.arange(N_SHIFTED + 1.0)
    y = torch.ones(N_SHIFTED)
    want = buf.clone()
    want[1:] = 2.0 * want[:-1] + y
    multi_tensor_axpby([buf[:-1]], [y], [buf[1:]], 2.0, 1.0, torch.zeros(1, dtype=torch.int))
    assert torch.equal(buf, want)


def test_an_optimizer_sweep_refuses_tensors_of_one_row_that_share_memory(path):
    """The optimizer sweeps read every tensor where it is: a gradient shifted over its own
    parameter, or one tensor given as both moments, is refused; a gradient that is its
    parameter (each element read, then written) is accepted, as torch's fused step takes it."""
    kw = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    base = torch.arange(6.0)
    before = base.clone()
    with pytest.raises(SharedMemoryError, match=r"adam_step: params\[0\] and grads\[0\] share "
                       r"memory, and the sweep writes params\[0\]"):
        adam_step([base[1:5]], [base[:4]], [torch.zeros(4)], [torch.zeros(4)],
                  [torch.zeros(())], **kw)
    moment = torch.zeros(4)
    with pytest.raises(SharedMemoryError, match=r"exp_avgs\[0\] and exp_avg_sqs\[0\]"):
        adam_step([torch.zeros(4)], [torch.ones(4)], [moment, ], [moment], [torch.zeros(())],
                  **kw)
    assert torch.equal(base, before) and torch.equal(moment, torch.zeros(4))
    p = torch.full((4,), 2.0)
    want = torch.full((4,), 2.0)
    adam_step([want], [torch.full((4,), 2.0)], [torch.zeros(4)], [torch.zeros(4)],
              [torch.zeros(())], **kw)
    adam_step([p], [p], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())], **kw)
    assert torch.equal(p, want)


def test_an_in_place_unscale_refuses_an_addend_that_is_another_rows_source(path):
    a, b = torch.full((4,), 8.0), torch.full((4,), 8.0)
    with pytest.raises(SharedMemoryError, match=r"srcs\[0\] and adds\[1\] share memory"):
        check_unscale([a, b], SCALE, None, adds=[torch.zeros(4), a])
    assert torch.equal(a, torch.full((4,), 8.0)) and torch.equal(b, a)


def test_an_optimizer_given_a_gradient_that_is_another_parameter_refuses_it_at_any_step(path):
    """The optimizers rebind a kept sweep to each step's gradients: a gradient that
    appears at a later step inside memory the step writes is refused there too."""
    torch.manual_seed(0)
    w0, w1 = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([w0, w1], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (w0 * w1).sum().backward()
        opt.step()
    opt.zero_grad()
    (w0 * w1).sum().backward()
    w1.grad = w0.detach()  # (read while w0 is written)
    before = _snapshot(w0, w1, *[v for s in opt.state.values() for v in s.values()])
    with pytest.raises(SharedMemoryError, match=r"share memory"):
        opt.step()
    assert _unchanged(before, w0, w1, *[v for s in opt.state.values() for v in s.values()])


def test_a_rebound_destination_at_its_sources_address_but_wider_is_not_taken_as_in_place(path):
    src = [torch.ones(8, dtype=torch.float16), torch.ones(8, dtype=torch.float16)]
    kept = check_unscale_prepare(src, dsts=[torch.zeros(8), torch.zeros(8)])
    assert kept.rebindable_writes
    wide = torch.zeros(8)  # fp32: twice the bytes of an fp16 source at its address
    narrow = wide.view(torch.float16)[:8]
    assert not kept.rebind_lists([src[0], narrow], [torch.zeros(8), wide])


def test_strided_views_are_judged_exactly_and_cheaply_when_they_share_a_layout():
    import itertools
    import random
    rng = random.Random(0)
    buf = torch.zeros(256, dtype=torch.float64)

    def view(dtype, shape, stride):
        v = buf.view(dtype)
        room = v.numel() - 1 - sum((n - 1) * s for n, s in zip(shape, stride))
        return v.as_strided(shape, stride, rng.randint(0, min(room, 120)))

    def elements(t):
        size = t.element_size()
        return {b for idx in itertools.product(*map(range, t.shape))
                for off in [t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride()))]
                for b in range(off * size, off * size + size)}

    for _ in range(300):
        dtype = rng.choice([torch.float64, torch.float32, torch.float16])
        shape = [rng.choice([1, 2, 3, 5]) for _ in range(rng.randint(1, 3))]
        stride = [rng.choice([1, 2, 3, 7, 13]) for _ in shape]
        a = view(dtype, shape, stride)
        b = view(dtype, shape, stride) if rng.random() < 0.6 else \
            view(rng.choice([torch.float32, torch.float16]), [rng.choice([2, 3])],
                 [rng.choice([1, 2, 5])])
        want = bool(elements(a) & elements(b))
        try:
            refuse_shared_rows("t", [("outs", [a, b], True)])
            got = False
        except SharedMemoryError:
            got = True
        assert got == want, (a.shape, a.stride(), b.shape, b.stride())
    # the halves of a 16 MiB matrix, interleaved column by column, share nothing
    w = torch.zeros(1024, 4100)
    refuse_shared_rows("t", [("outs", [w[:, 0::2], w[:, 1::2]], True)])


def test_one_step_count_given_to_two_rows_is_refused(path):
    """The step counts are written (advanced) by the sweep: one tensor for two rows would
    be advanced twice, the rows seeing different steps on one path and the same on the
    other."""
    s = torch.zeros(())
    ps = [torch.ones(4), torch.ones(4)]
    with pytest.raises(SharedMemoryError, match=r"adam_step: steps\[0\] and steps\[1\]"):
        adam_step(ps, [torch.ones(4), torch.ones(4)], [torch.zeros(4), torch.zeros(4)],
                  [torch.zeros(4), torch.zeros(4)], [s, s], lr=0.1, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.0)
    assert s.item() == 0.0 and all(torch.equal(p, torch.ones(4)) for p in ps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_grad_norm_refuses_one_gradient_given_to_two_parameters_by_place(dtype, path):
    """A gradient given to two parameters would be scaled twice (and counted twice in the
    norm), on the sweeps' path and on torch's, which float64 gradients take: refused on
    both, naming the parameters' places, before anything is written; also when the kept
    sweeps of an earlier call would be rebound to the shared gradient."""
    from tritamp.optimizers import clip_grad_norm_
    params = [torch.nn.Parameter(torch.zeros(4, dtype=dtype)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((4,), 10.0, dtype=dtype)
    clip_grad_norm_(params, 1.0)  # (apart: clipped; kept for the next call's rebind)
    shared = torch.full((4,), 10.0, dtype=dtype)
    params[0].grad = torch.full((4,), 10.0, dtype=dtype)
    params[1].grad = params[2].grad = shared
    with pytest.raises(SharedMemoryError, match=r"clip_grad_norm_: gradients\[1\] "
                       r"\(parameters\[1\]\) and gradients\[2\] \(parameters\[2\]\) share"):
        clip_grad_norm_(params, 1.0)
    assert torch.equal(shared, torch.full((4,), 10.0, dtype=dtype))
    assert torch.equal(params[0].grad, torch.full((4,), 10.0, dtype=dtype))
    params[0].grad = None  # (the places count every parameter, with a gradient or not)
    with pytest.raises(SharedMemoryError, match=r"gradients\[0\] \(parameters\[1\]\)"):
        clip_grad_norm_(params, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_larc_refuses_one_gradient_given_to_two_parameters_by_place(dtype, path):
    """LARC rescales each gradient in place: one given to two parameters would be
    rescaled twice. Refused on the sweep's path and on the per-parameter rewrite that
    float64 takes, naming the parameters' places in their group, before anything is
    written; also after a step whose gradients were apart (the kept rewrite rebound)."""
    from tritamp.parallel import LARC
    params = [torch.nn.Parameter(torch.full((4,), float(i + 1), dtype=dtype))
              for i in range(3)]
    opt = LARC(torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1))
    for p in params:
        p.grad = torch.full((4,), 0.5, dtype=dtype)
    opt.step()
    shared = torch.full((4,), 0.5, dtype=dtype)
    params[0].grad = torch.full((4,), 0.5, dtype=dtype)
    params[1].grad = params[2].grad = shared
    before = _snapshot(*params)
    with pytest.raises(SharedMemoryError, match=r"LARC: gradients\[0\] \(param_groups\[1\]"
                       r"\['params'\]\[0\]\) and gradients\[1\] \(param_groups\[1\]"
                       r"\['params'\]\[1\]\) share memory"):
        opt.step()
    assert _unchanged(before, *params)
    assert torch.equal(shared, torch.full((4,), 0.5, dtype=dtype))
    assert torch.equal(params[0].grad, torch.full((4,), 0.5, dtype=dtype))


def test_clip_grad_norm_still_hands_sparse_and_meta_gradients_to_torch(path):
    """The shared-gradient check of clip_grad_norm_'s fallback (torch's clipping, for
    another norm type) skips gradients that have no memory to share: a sparse one, which
    torch clips, and meta ones."""
    from tritamp.optimizers import clip_grad_norm_
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    twin = torch.nn.Embedding(10, 4, sparse=True)
    twin.load_state_dict(emb.state_dict())
    twin(torch.tensor([1, 2])).sum().backward()
    ours = clip_grad_norm_(emb.parameters(), 0.5, norm_type=float("inf"))
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5, norm_type=float("inf"))
    assert torch.equal(ours, theirs)
    assert torch.equal(emb.weight.grad.to_dense(), twin.weight.grad.to_dense())
    metas = [torch.nn.Parameter(torch.empty(3, device="meta")) for _ in range(2)]
    for p in metas:
        p.grad = torch.empty(3, device="meta")
    clip_grad_norm_(metas, 1.0, norm_type=float("inf"))  # (as torch's: no refusal)
