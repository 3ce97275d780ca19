"""SyncBatchNorm under torch.distributed (2 gloo processes on CPU, launched once by
torchrun with this file as the script): SyncBatchNorm whose group's batch holds one
value per channel in all (one rank holds a single sample, the other none) refuses it on
every rank with torch's BatchNorm error, before the running statistics or
``num_batches_tracked`` change (the unbiased variance of one value is 0/0: the running
variance was silently NaN), on the production CPU path and on the Triton kernels in
Triton's interpreter; a group batch of two values still trains."""
import importlib
import json
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # each case then picks its path

import torch  # noqa: E402


def _one_value_over_the_group(rank, channel_last):
    from tritamp.parallel import SyncBatchNorm
    torch.manual_seed(0)
    m = SyncBatchNorm(3, channel_last=channel_last)
    shape = (1, 1, 3) if channel_last else (1, 3, 1)  # one value per channel
    x = torch.randn(shape)[: 1 if rank == 0 else 0]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        m(x)
        message = None
    except ValueError as e:
        message = str(e)
    def bits(t):
        return t.reshape(-1).view(torch.uint8)

    unchanged = all(torch.equal(bits(v), bits(before[k])) for k, v in m.state_dict().items())
    return dict(message=message, unchanged=unchanged,
                finite=bool(torch.isfinite(m.running_var).all()))


def _two_values_over_the_group(rank):
    from tritamp.parallel import SyncBatchNorm
    m = SyncBatchNorm(3)
    x = torch.tensor([[1.0, 2.0, 3.0]]) * (1 + rank)  # one sample on each rank
    y = m(x)
    ref = torch.nn.BatchNorm1d(3)
    yr = ref(torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]))[rank:rank + 1]
    return dict(close=bool(torch.allclose(y, yr, atol=1e-5)),
                var_close=bool(torch.allclose(m.running_var, ref.running_var, atol=1e-5)),
                counted=int(m.num_batches_tracked))


def _main(out):
    import torch.distributed as dist
    importlib.import_module("tritamp.parallel")  # (Triton imported while TRITON_INTERPRET=1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    report = {}
    for interpret in ("0", "1"):
        os.environ["TRITON_INTERPRET"] = interpret
        for last in (False, True):
            report[f"one/{interpret}/{last}"] = _one_value_over_the_group(rank, last)
        report[f"two/{interpret}"] = _two_values_over_the_group(rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (gloo's threads may abort the interpreter's finalization)

import pytest  # noqa: E402

from conftest import torchrun  # noqa: E402


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out = tmp_path_factory.mktemp("syncbn_group_batch")
    torchrun(os.path.abspath(__file__), out, timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["cpu_path", "interpreted"])
@pytest.mark.parametrize("channel_last", [False, True])
def test_syncbn_refuses_a_group_batch_of_one_value_per_channel_on_every_rank(
        reports, interpret, channel_last):
    for rank, rep in enumerate(reports):
        r = rep[f"one/{interpret}/{channel_last}"]
        assert r["message"] is not None and \
            "Expected more than 1 value per channel when training" in r["message"], (rank, r)
        assert r["unchanged"] and r["finite"], (rank, r)
        # one sample on each rank is two values per channel over the group: it trains
        two = rep[f"two/{interpret}"]
        assert two["close"] and two["var_close"] and two["counted"] == 1, (rank, two)
