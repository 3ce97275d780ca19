"""The simple and DCGAN examples run end to end on tiny generated data at every opt
level (bf16; one fp16 run each, fp16 arithmetic being slow on a CPU)."""
import importlib.util
import math
import os

import pytest
import torch
import torch.nn as nn

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


simple = _load("example_simple_main", "simple/main.py")
dcgan = _load("example_dcgan_main_amp", "dcgan/main_amp.py")

LEVELS = [(lvl, "bf16") for lvl in ("O0", "O1", "O2", "O3")] + [("O2", "fp16")]
TINY_GAN = ["--imageSize", "16", "--ngf", "4", "--ndf", "4", "--nz", "8", "--batchSize", "2",
            "--dataset-size", "4", "--niter", "1", "--device", "cpu"]


@pytest.mark.parametrize("opt_level,half", LEVELS, ids=[f"{a}-{b}" for a, b in LEVELS])
def test_simple_example_trains(opt_level, half, capsys):
    losses = simple.main(["--opt-level", opt_level, "--half-dtype", half, "--steps", "6",
                          "--device", "cpu"])
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert "step   5" in capsys.readouterr().out


@pytest.mark.parametrize("opt_level,half", LEVELS, ids=[f"{a}-{b}" for a, b in LEVELS])
def test_dcgan_example_runs_two_iterations(opt_level, half, tmp_path, capsys):
    history = dcgan.main(TINY_GAN + ["--opt_level", opt_level, "--half-dtype", half,
                                     "--outf", str(tmp_path), "--no-images"])
    assert [(r["epoch"], r["iter"]) for r in history] == [(0, 0), (0, 1)]
    for row in history:
        assert all(math.isfinite(v) for v in row.values()), row
    out = capsys.readouterr().out
    assert "[0/1][1/2] Loss_D:" in out
    ckpt = torch.load(tmp_path / "amp_epoch_0.pth", weights_only=True)
    assert set(ckpt["amp"]) == {"loss_scaler0", "loss_scaler1", "loss_scaler2"}
    assert set(ckpt) == {"optimizerD", "optimizerG", "amp"}
    for name in ("netG_epoch_0.pth", "netD_epoch_0.pth"):
        state = torch.load(tmp_path / name, weights_only=True)
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    if half == "fp16" and opt_level == "O2":
        # three independent dynamic scalers; D's two losses both fed its one step
        scales = [ckpt["amp"][f"loss_scaler{i}"]["loss_scale"] for i in range(3)]
        assert all(0 < s <= 2.**16 for s in scales)


def test_dcgan_resumes_from_its_checkpoints(tmp_path, capsys):
    args = TINY_GAN + ["--opt_level", "O2", "--half-dtype", "bf16", "--no-images"]
    first = dcgan.main(args + ["--outf", str(tmp_path / "a")])
    again = dcgan.main(args + ["--outf", str(tmp_path / "b")])
    assert first == again  # same seed, same data: a run is reproducible
    resumed = dcgan.main(args + ["--outf", str(tmp_path / "c"),
                                 "--netG", str(tmp_path / "a" / "netG_epoch_0.pth"),
                                 "--netD", str(tmp_path / "a" / "netD_epoch_0.pth")])
    # D(x) of the first batch now comes from the trained discriminator
    assert resumed[0]["D_x"] != first[0]["D_x"]
    assert all(math.isfinite(v) for row in resumed for v in row.values())


@pytest.mark.parametrize("size", [8, 16, 32, 64])
def test_dcgan_network_depth_follows_the_image_size(size):
    g = dcgan.Generator(nz=8, ngf=4, nc=3, image_size=size)
    d = dcgan.Discriminator(ndf=4, nc=3, image_size=size)
    fake = g(torch.randn(2, 8, 1, 1))
    assert fake.shape == (2, 3, size, size)
    assert d(fake).shape == (2,)
    if size == 64:  # Apex's networks, layer for layer
        convs = [(m.in_channels, m.out_channels) for m in g.modules()
                 if isinstance(m, nn.ConvTranspose2d)]
        assert convs == [(8, 32), (32, 16), (16, 8), (8, 4), (4, 3)]
        convs = [(m.in_channels, m.out_channels) for m in d.modules() if isinstance(m, nn.Conv2d)]
        assert convs == [(3, 4), (4, 8), (8, 16), (16, 32), (32, 1)]


@pytest.mark.parametrize("size", [4, 24, 0])
def test_dcgan_refuses_image_sizes_it_cannot_build(size):
    with pytest.raises(SystemExit, match="power of two"):
        dcgan.Generator(nz=8, ngf=4, nc=3, image_size=size)


def test_dcgan_trains_on_an_image_folder_with_apexs_flags(tmp_path, capsys):
    """Apex's --dataset / --dataroot: an ImageFolder (folder, imagenet, lfw) read through
    torchvision, resized and centre-cropped to --imageSize."""
    pytest.importorskip("torchvision")
    from PIL import Image
    gen = torch.Generator().manual_seed(0)
    (tmp_path / "data" / "cls").mkdir(parents=True)
    for i in range(4):
        pixels = (torch.rand(20, 24, 3, generator=gen) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / "data" / "cls" / f"{i}.png")
    i = TINY_GAN.index("--dataset-size")
    args = TINY_GAN[:i] + TINY_GAN[i + 2:]  # (the folder's four images make the epoch)
    history = dcgan.main(args + ["--dataset", "folder", "--dataroot", str(tmp_path / "data"),
                                 "--classes", "bedroom", "--opt_level", "O1",
                                 "--half-dtype", "bf16", "--outf", str(tmp_path / "out"),
                                 "--no-images"])
    assert [(r["epoch"], r["iter"]) for r in history] == [(0, 0), (0, 1)]
    assert all(math.isfinite(v) for row in history for v in row.values())
