"""Host-side promises of the small kernels' launchers that hold on both paths (Triton's
interpreter and the production CPU path): check_unscale's layouts (a column slice
unscaled in place, a destination that is a transposed view of its own source; rows that
share memory are refused, see test_shared_rows.py),
scale_update's Apex/torch defaults and its refusal of a slot that is not an overflow
slot, count_nonfinite's counts length against its index and its no-op on a clean step,
a kept L2 norm of a strided view reading today's values, axpby's arg_to_check, and the
Kahan remainder of a non-finite value. Tensors are tiny.
"""
import pytest
import torch

from tritamp.kernels import rounding
from tritamp.kernels.axpby import multi_tensor_axpby
from tritamp.kernels.check_unscale import check_unscale
from tritamp.kernels.l2norm import multi_tensor_l2norm_launch, multi_tensor_l2norm_prepare
from tritamp.kernels.overflow import count_nonfinite
from tritamp.kernels.scale_update import (FOUND_INF, FOUND_INF_NEXT, SCALE, STATE_SIZE,
                                          UNSKIPPED, scale_update)


def _bitwise(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --- check_unscale ---------------------------------------------------------------------
def test_in_place_unscale_of_a_column_slice_is_accepted_and_leaves_the_rest(path):
    # strides (4, 1): not dense, but no element overlaps another
    base = torch.arange(16, dtype=torch.float32).reshape(4, 4) * 8
    expected = base.clone()
    expected[:, :3] /= 8
    view = base[:, :3]
    found = torch.zeros(())
    check_unscale([view], torch.tensor(8.0), found)
    assert torch.equal(base, expected)
    assert found.item() == 0.0


def test_destination_that_is_a_transposed_view_of_its_source_reads_the_source(path):
    # dst[i, j] = src[i, j] / 2 with dst = src.t(): the source is read before the write
    base = torch.arange(9, dtype=torch.float32).reshape(3, 3) * 2
    expected = base.t() / 2
    check_unscale([base], torch.tensor(2.0), torch.zeros(()), dsts=[base.t()])
    assert torch.equal(base.t(), expected.t()) and torch.equal(base, expected)


# --- scale_update ----------------------------------------------------------------------
def _state(scale, unskipped=0.0, found=0.0):
    state = torch.zeros(STATE_SIZE)
    state[SCALE], state[UNSKIPPED], state[FOUND_INF] = scale, unskipped, found
    state[2] = 1.0  # HYSTERESIS
    return state


def test_scale_update_defaults_are_torchs_growth_interval_and_factors(path):
    # torch.amp.GradScaler: growth_factor 2.0, backoff_factor 0.5, growth_interval 2000
    state = _state(1024.0, unskipped=1998.0)
    scale_update(state)
    assert state[SCALE].item() == 1024.0 and state[UNSKIPPED].item() == 1999.0
    scale_update(state)
    assert state[SCALE].item() == 2048.0 and state[UNSKIPPED].item() == 0.0
    state[FOUND_INF] = 1.0
    scale_update(state)
    assert state[SCALE].item() == 1024.0


@pytest.mark.parametrize("slot", [SCALE, UNSKIPPED, STATE_SIZE, -1])
def test_scale_update_refuses_a_slot_that_is_not_an_overflow_slot(slot, path):
    state = _state(8.0, found=1.0)
    before = state.clone()
    with pytest.raises(ValueError, match=rf"found_slot must be FOUND_INF \({FOUND_INF}\) or "
                                         rf"FOUND_INF_NEXT \({FOUND_INF_NEXT}\), got {slot}"):
        scale_update(state, found_slot=slot)
    assert torch.equal(state, before)


# --- count_nonfinite -------------------------------------------------------------------
def test_count_nonfinite_refuses_counts_shorter_than_its_index_needs(path):
    x = torch.tensor([float("inf"), 1.0])
    counts = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"counts must be a contiguous int32 tensor of at "
                                         r"least 4 entries"):
        count_nonfinite([x], counts, torch.ones(()), index=[3])
    assert counts.tolist() == [0, 0]


def test_count_nonfinite_counts_nothing_on_a_clean_step(path):
    # the flag decides, not the values: a clean step reads no gradient
    x = torch.tensor([float("inf"), float("nan"), 1.0])
    counts = torch.zeros(1, dtype=torch.int32)
    count_nonfinite([x], counts, torch.zeros(()))
    assert counts.tolist() == [0]
    count_nonfinite([x], counts, torch.ones(()))
    assert counts.tolist() == [2]


# --- multi_tensor_l2norm ---------------------------------------------------------------
def test_kept_norm_of_a_strided_view_reads_its_current_values(path):
    base = torch.ones(4, 8)
    prepared = multi_tensor_l2norm_prepare([base[:, ::2]])
    total, _ = multi_tensor_l2norm_launch(prepared)
    assert total.item() == 4.0  # sqrt(16 ones)
    base.fill_(2.0)
    total, _ = multi_tensor_l2norm_launch(prepared)
    assert total.item() == 8.0


# --- multi_tensor_axpby ----------------------------------------------------------------
@pytest.mark.parametrize("arg_to_check", [0, 1])
def test_axpby_checks_only_the_input_arg_to_check_names(arg_to_check, path):
    inf = torch.tensor([float("inf"), 1.0])
    one = torch.tensor([1.0, 1.0])
    # the unchecked input holds the inf: the flag stays clear, the output is still written
    xs, ys = ([inf], [one.clone()]) if arg_to_check == 1 else ([one.clone()], [inf])
    out = torch.zeros(2)
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_axpby(xs, ys, [out], 2.0, 3.0, flag, arg_to_check)
    assert flag.item() == 0
    assert torch.isinf(out[0]) and out[1].item() == 5.0
    # and the checked input holding it sets the flag
    multi_tensor_axpby(ys, xs, [out], 2.0, 3.0, flag, arg_to_check)
    assert flag.item() == 1


# --- bf16 rounding ---------------------------------------------------------------------
def test_kahan_remainder_of_a_non_finite_value_is_zero():
    r = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.5, -3.0])
    out = rounding.kahan_remainder_(r)
    assert out is r
    assert _bitwise(r, torch.tensor([0.0, 0.0, 0.0, 1.5, -3.0]))
