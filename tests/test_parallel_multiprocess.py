"""SyncBatchNorm across 2 and 3 processes (gloo, CPU) against torch's BatchNorm on the
concatenated batch in one process, and a converted torchvision ResNet-18 trained under
``torch.distributed.run`` against the same ResNet trained on the whole batch.

Each world is launched once per session (tests/scripts/parallel_launch.py); ranks get
uneven slices of one seeded batch (one rank may hold a single sample, or none), inputs
have a mean far from 0 against their spread, and every case trains two steps so that
running statistics and ``num_batches_tracked`` move twice. Cases marked ``interpret``
run the Triton kernels in Triton's interpreter inside the workers; the others take the
torch reference path, which is what CPU training uses.

Comparisons: outputs and input gradients against torch in the input's dtype with the
tolerance table; each rank's parameter gradients are local (DistributedDataParallel
averages them), so their sum over ranks is compared with torch's full-batch gradient;
and everything is also held to within 2x torch's own error against a float64 run, plus
the table's atol.
"""
import os
import sys

import pytest
import torch

from conftest import TOL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import parallel_launch  # noqa: E402
import syncbn_worker  # noqa: E402
from parallel_launch import CASES_2, CASES_3  # noqa: E402


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return parallel_launch.world2(tmp_path_factory)


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return parallel_launch.world3(tmp_path_factory)


# -- the single-process reference --------------------------------------------------------------
def _torch_bn(case, dtype):
    c, dims = case["channels"], len(case["spatial"])
    cls = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d,
           3: torch.nn.BatchNorm3d}[dims]
    return cls(c, momentum=case.get("momentum", 0.1), affine=case.get("affine", True),
               dtype=torch.float64 if dtype == torch.float64 else None)


def reference(case, dtype=None, rows=None):
    """torch's BatchNorm on the whole batch (or its samples ``rows = (lo, hi)``), step by
    step, in the case's dtype (or float64: the yardstick) with fp32 (float64) parameters."""
    data = syncbn_worker.make_data(case)
    lo, hi = rows if rows is not None else (0, sum(case["batches"]))
    bn = _torch_bn(case, dtype)
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(data["weight"])
            bn.bias.copy_(data["bias"])
    out = dict(y=[], dx=[], dz=[], dw=[], db=[])
    for step in data["steps"]:
        cast = (lambda t: t[lo:hi].to(dtype)) if dtype is not None else (lambda t: t[lo:hi])
        x = cast(step["x"]).requires_grad_()
        z = cast(step["z"]).requires_grad_() if step["z"] is not None else None
        y = bn(x)
        if z is not None:
            y = y + z
        if case.get("fuse_relu"):
            y = torch.relu(y)
        y.backward(cast(step["dy"]))
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["dz"].append(z.grad if z is not None else None)
        if bn.affine:
            out["dw"].append(bn.weight.grad.clone())
            out["db"].append(bn.bias.grad.clone())
            bn.weight.grad = bn.bias.grad = None
    out["running_mean"], out["running_var"] = bn.running_mean, bn.running_var
    out["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    with torch.no_grad():
        last = data["steps"][-1]
        x = last["x"][lo:hi]
        y = bn(x.to(dtype) if dtype is not None else x)
        if last["z"] is not None:
            z = last["z"][lo:hi]
            y = y + (z.to(dtype) if dtype is not None else z)
        out["y_eval"] = torch.relu(y) if case.get("fuse_relu") else y
    return out


def gathered(out_dir, case, group):
    """The results of the ranks in ``group``: per-sample tensors concatenated, parameter
    gradients summed."""
    ranks = [torch.load(os.path.join(str(out_dir), f"{case['name']}.rank{r}.pt"))
             for r in group]
    res = {}
    for key in ("y", "dx", "dz"):
        res[key] = [None if ranks[0][key][s] is None else
                    torch.cat([r[key][s] for r in ranks]) for s in range(case["steps"])]
    for key in ("dw", "db"):
        res[key] = [torch.stack([r[key][s] for r in ranks]).sum(0)
                    for s in range(len(ranks[0][key]))]
    res["y_eval"] = torch.cat([r["y_eval"] for r in ranks])
    for key in ("running_mean", "running_var", "num_batches_tracked", "channels_last_out"):
        res[key] = ranks[0][key]
        for r in ranks[1:]:
            if torch.is_tensor(r[key]):
                assert torch.equal(r[key], res[key]), f"ranks disagree on {key}"
            else:
                assert r[key] == res[key], f"ranks disagree on {key}"
    return res


def _pairs(case, got, ref, exact):
    """(name, ours, torch's, float64's, dtype of the tolerance) for every compared tensor."""
    dtype = getattr(torch, case["dtype"])
    for s in range(case["steps"]):
        for key in ("y", "dx", "dz"):
            if got[key][s] is not None:
                yield f"{key}[{s}]", got[key][s], ref[key][s], exact[key][s], dtype
        for key in ("dw", "db"):
            if got[key]:
                yield f"{key}[{s}]", got[key][s], ref[key][s], exact[key][s], torch.float32
    yield "y_eval", got["y_eval"], ref["y_eval"], exact["y_eval"], dtype
    for key in ("running_mean", "running_var"):
        yield key, got[key], ref[key], exact[key], torch.float32


def check_case(out_dir, case):
    """Every group of ranks (``group_size``, default all) against torch on its samples."""
    world = len(case["batches"])
    size = case.get("group_size") or world
    for first in range(0, world, size):
        group = range(first, first + size)
        rows = (sum(case["batches"][:first]), sum(case["batches"][:first + size]))
        _check_group(out_dir, case, group, rows)


def _check_group(out_dir, case, group, rows):
    got = gathered(out_dir, case, group)
    ref = reference(case, rows=rows)
    exact = reference(case, torch.float64, rows=rows)
    assert got["num_batches_tracked"] == ref["num_batches_tracked"] == case["steps"]
    if case["layout"] == "channels_last":
        assert got["channels_last_out"], "the output lost the channels-last memory format"
    for name, ours, theirs, truth, dtype in _pairs(case, got, ref, exact):
        assert ours.dtype == theirs.dtype, name
        torch.testing.assert_close(ours, theirs, **TOL[dtype], msg=lambda m: f"{name}: {m}")
        if not ours.numel():  # (every rank empty: nothing to measure against float64)
            continue
        err = (ours.double() - truth).abs().max().item()
        torch_err = (theirs.double() - truth).abs().max().item()
        assert err <= 2 * torch_err + TOL[dtype]["atol"], (name, err, torch_err)


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c["name"])
def test_two_processes_match_batchnorm_on_the_whole_batch(world2, case):
    check_case(world2, case)


@pytest.mark.parametrize("case", CASES_3, ids=lambda c: c["name"])
def test_three_processes_match_batchnorm_on_the_whole_batch(world3, case):
    check_case(world3, case)


def test_create_syncbn_process_group_refuses_a_size_that_does_not_divide_the_world(world2):
    r = torch.load(os.path.join(str(world2), "w2_group_of_two.rank0.pt"))
    assert r["bad_group_size_error"] == ("create_syncbn_process_group: group_size 3 must divide "
                                         "the world size 2 (or be 0 for the whole world)")


def test_converted_resnet18_under_torchrun_matches_one_process(world2):
    """DDP(convert_syncbn_model(resnet18)), 2 ranks x 4 images of 16x16, two SGD steps,
    against resnet18 with BatchNorm on the 8 images in one process: losses, weights and
    running statistics, held to 2x the single fp32 run's own error against float64 (plus
    the table's atol)."""
    r0 = torch.load(os.path.join(str(world2), "resnet.rank0.pt"))
    r1 = torch.load(os.path.join(str(world2), "resnet.rank1.pt"))
    assert r0["n_syncbn"] == 20
    err = (r0["sync_losses"].double() - r0["exact_losses"]).abs().max().item()
    single_err = (r0["single_losses"].double() - r0["exact_losses"]).abs().max().item()
    atol = TOL[torch.float32]["atol"]
    assert err <= 2 * single_err + atol, ("losses", err, single_err)
    sync, single, exact = r0["sync_state"], r0["single_state"], r0["exact_state"]
    assert sync.keys() == single.keys()
    for key, value in sync.items():
        assert torch.equal(value, r1["sync_state"][key]), f"ranks disagree on {key}"
        if not value.is_floating_point():
            assert torch.equal(value, single[key]), key
            continue
        err = (value.double() - exact[key]).abs().max().item()
        single_err = (single[key].double() - exact[key]).abs().max().item()
        assert err <= 2 * single_err + atol, (key, err, single_err)
