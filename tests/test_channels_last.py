"""Channels-last models: their gradients are dense but not contiguous, and the sweeps
walk them flat in the layout they share with their partners."""
import copy

import torch
import torch.nn as nn

from tritamp import amp
from tritamp.kernels import check_unscale, check_unscale_ref


def test_check_unscale_handles_channels_last_tensors():
    torch.manual_seed(0)
    g = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last).half() * 512
    g[1, 2, 3, 4] = float("inf")
    master = torch.empty(g.shape).to(memory_format=torch.channels_last)
    ref = torch.empty_like(master)
    f, f_ref = torch.zeros(()), torch.zeros(())
    scale = torch.tensor(512.0)
    check_unscale([g], scale, f, dsts=[master])
    check_unscale_ref([g], scale, f_ref, dsts=[ref])
    assert f.item() == f_ref.item() == 1.0
    assert torch.equal(master.nan_to_num(), ref.nan_to_num())
    assert torch.equal(master.nan_to_num(), (g.float() / 512).nan_to_num())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3))


def test_o2_trains_a_channels_last_model_like_a_contiguous_one():
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
    results = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = _net().to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x.contiguous(memory_format=fmt)), y)
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        assert model[0].weight.is_contiguous(memory_format=fmt)
        results.append(copy.deepcopy(model.state_dict()))
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], rtol=1e-3, atol=1e-4)
