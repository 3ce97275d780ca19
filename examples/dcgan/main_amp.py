"""Mixed-precision DCGAN training with tritamp's amp: two models, two optimizers, three
losses, one loss scaler per loss (``num_losses=3``, ``loss_id`` 0, 1, 2).

Apex's ``examples/dcgan/main_amp.py`` with its import changed, on generated data by
default (no download; Apex's data sets with ``--dataset`` and ``--dataroot``), and a
network whose depth follows ``--imageSize`` (any power of two >= 8; at 64 it is Apex's
network layer for layer). Runs on CPU or GPU:

    python examples/dcgan/main_amp.py --opt_level O1
    python examples/dcgan/main_amp.py --opt_level O2 --half-dtype bf16 --imageSize 32 --niter 1
"""
import argparse
import math
import os
import random

import torch
import torch.nn as nn

from tritamp import amp  # was: from apex import amp


def build_parser():
    p = argparse.ArgumentParser(description="tritamp DCGAN (generated data)")
    p.add_argument("--dataset", default="fake", choices=list(DATASETS),
                   help="cifar10 | lsun | mnist | imagenet | folder | lfw (Apex's, through "
                        "torchvision, from --dataroot; cifar10 and mnist download there) | "
                        "fake: random images generated in memory (the default: downloads "
                        "nothing)")
    p.add_argument("--dataroot", default="./", help="path to dataset")
    p.add_argument("--classes", default="bedroom",
                   help="comma separated list of classes for the lsun data set")
    p.add_argument("--dataset-size", type=int, default=1000,
                   help="number of generated images per epoch (torchvision FakeData's default)")
    p.add_argument("--workers", type=int, default=0, help="number of data loading workers")
    p.add_argument("--batchSize", type=int, default=64, help="input batch size")
    p.add_argument("--imageSize", type=int, default=64,
                   help="height / width of the images: a power of two >= 8")
    p.add_argument("--nz", type=int, default=100, help="size of the latent z vector")
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--niter", type=int, default=25, help="number of epochs to train for")
    p.add_argument("--lr", type=float, default=0.0002, help="learning rate, default=0.0002")
    p.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam. default=0.5")
    p.add_argument("--netG", default="", help="path to netG (to continue training)")
    p.add_argument("--netD", default="", help="path to netD (to continue training)")
    p.add_argument("--outf", default=".", help="folder for sample images and checkpoints")
    p.add_argument("--manualSeed", type=int, help="manual seed")
    p.add_argument("--opt_level", default="O1", help='amp opt_level, default="O1"')
    p.add_argument("--half-dtype", default="fp16", choices=["fp16", "bf16"],
                   help="the half precision type of O1-O3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-images", action="store_true",
                   help="do not write sample images (they need torchvision)")
    return p


def weights_init(m):
    """DCGAN's initialisation: conv weights N(0, 0.02), BatchNorm weights N(1, 0.02)."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


def _upsamplings(image_size):
    n = int(round(math.log2(image_size))) if image_size > 0 else 0
    if image_size < 8 or 2 ** n != image_size:
        raise SystemExit(f"--imageSize must be a power of two >= 8 (8, 16, 32, 64, 128, ...), "
                         f"got {image_size}")
    return n - 2  # 4x4 after the first layer, doubled by each stride-2 layer


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc, image_size):
        super().__init__()
        ups = _upsamplings(image_size)
        mult = 2 ** (ups - 1)
        layers = [nn.ConvTranspose2d(nz, ngf * mult, 4, 1, 0, bias=False),
                  nn.BatchNorm2d(ngf * mult), nn.ReLU(True)]  # (ngf*mult) x 4 x 4
        while mult > 1:
            layers += [nn.ConvTranspose2d(ngf * mult, ngf * mult // 2, 4, 2, 1, bias=False),
                       nn.BatchNorm2d(ngf * mult // 2), nn.ReLU(True)]
            mult //= 2
        layers += [nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh()]  # nc x size x size
        self.main = nn.Sequential(*layers)

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc, image_size):
        super().__init__()
        ups = _upsamplings(image_size)
        layers = [nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        mult = 1
        for _ in range(ups - 1):
            layers += [nn.Conv2d(ndf * mult, ndf * mult * 2, 4, 2, 1, bias=False),
                       nn.BatchNorm2d(ndf * mult * 2), nn.LeakyReLU(0.2, inplace=True)]
            mult *= 2
        layers += [nn.Conv2d(ndf * mult, 1, 4, 1, 0, bias=False)]  # (ndf*mult) x 4 x 4 -> 1
        self.main = nn.Sequential(*layers)

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


DATASETS = ("fake", "cifar10", "lsun", "mnist", "imagenet", "folder", "lfw")


def torchvision_dataset(name, root, image_size, classes):
    """Apex's data sets (its script's choices), through torchvision: ``(dataset, nc)``.
    Images are resized, centre-cropped and normalised to [-1, 1], as in Apex."""
    try:
        import torchvision.datasets as dset
        import torchvision.transforms as transforms
    except ImportError:
        raise SystemExit(f"--dataset {name} needs torchvision (pip install torchvision, or "
                         "pip install -e '.[examples]'); --dataset fake needs nothing")
    if name == "mnist":
        return dset.MNIST(root=root, download=True, transform=transforms.Compose([
            transforms.Resize(image_size), transforms.ToTensor(),
            transforms.Normalize((0.5,), (0.5,))])), 1
    transform = transforms.Compose([
        transforms.Resize(image_size), transforms.CenterCrop(image_size),
        transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    if name in ("imagenet", "folder", "lfw"):
        return dset.ImageFolder(root=root, transform=transform), 3
    if name == "lsun":
        return dset.LSUN(root=root, classes=[c + "_train" for c in classes.split(",")],
                         transform=transform), 3
    return dset.CIFAR10(root=root, download=True, transform=transform), 3


def fake_dataset(size, image_size, nc, seed):
    """Random images in [-1, 1] (the range of the generator's tanh) with dummy labels."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(size, nc, image_size, image_size, generator=g) * 2 - 1
    return torch.utils.data.TensorDataset(images, torch.zeros(size, dtype=torch.long))


def _image_writer(disabled):
    if disabled:
        return None
    try:
        import torchvision.utils as vutils
    except ImportError:
        print("torchvision is not installed: no sample images are written (pass --no-images "
              "to silence this)")
        return None
    return vutils.save_image


def main(argv=None):
    opt = build_parser().parse_args(argv)
    print(opt)
    os.makedirs(opt.outf, exist_ok=True)
    if opt.manualSeed is None:
        opt.manualSeed = 2809
    print("Random Seed: ", opt.manualSeed)
    random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)

    device = torch.device(opt.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    half_dtype = torch.float16 if opt.half_dtype == "fp16" else torch.bfloat16
    if opt.dataset == "fake":
        nc = 3
        dataset = fake_dataset(opt.dataset_size, opt.imageSize, nc, opt.manualSeed)
    else:
        dataset, nc = torchvision_dataset(opt.dataset, opt.dataroot, opt.imageSize,
                                          opt.classes)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, shuffle=True,
                                             num_workers=opt.workers)
    save_image = _image_writer(opt.no_images)

    netG = Generator(opt.nz, opt.ngf, nc, opt.imageSize).to(device)
    netG.apply(weights_init)
    if opt.netG != "":
        netG.load_state_dict(torch.load(opt.netG, map_location=device))
    print(netG)
    netD = Discriminator(opt.ndf, nc, opt.imageSize).to(device)
    netD.apply(weights_init)
    if opt.netD != "":
        netD.load_state_dict(torch.load(opt.netD, map_location=device))
    print(netD)

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(opt.batchSize, opt.nz, 1, 1, device=device)
    real_label = 1.0
    fake_label = 0.0

    optimizerD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    [netD, netG], [optimizerD, optimizerG] = amp.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=opt.opt_level, num_losses=3,
        half_dtype=half_dtype)

    history = []
    for epoch in range(opt.niter):
        for i, data in enumerate(dataloader, 0):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, device=device)

            output = netD(real)
            errD_real = criterion(output, label)
            with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
                errD_real_scaled.backward()
            D_x = output.mean().item()

            # train with fake
            noise = torch.randn(batch_size, opt.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
                errD_fake_scaled.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
                errG_scaled.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            row = dict(epoch=epoch, iter=i, loss_D=errD.item(), loss_G=errG.item(), D_x=D_x,
                       D_G_z1=D_G_z1, D_G_z2=D_G_z2)
            history.append(row)
            print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                  % (epoch, opt.niter, i, len(dataloader), row["loss_D"], row["loss_G"], D_x,
                     D_G_z1, D_G_z2))
            if i % 100 == 0 and save_image is not None:
                save_image(real.float(), "%s/real_samples.png" % opt.outf, normalize=True)
                with torch.no_grad():
                    fake = netG(fixed_noise)
                save_image(fake.detach().float(),
                           "%s/amp_fake_samples_epoch_%03d.png" % (opt.outf, epoch), normalize=True)

        # do checkpointing: the models (fp32 state dicts at every opt level) as Apex did,
        # plus what resuming needs beyond them: the optimizers and the three loss scalers
        torch.save(netG.state_dict(), "%s/netG_epoch_%d.pth" % (opt.outf, epoch))
        torch.save(netD.state_dict(), "%s/netD_epoch_%d.pth" % (opt.outf, epoch))
        torch.save({"optimizerD": optimizerD.state_dict(), "optimizerG": optimizerG.state_dict(),
                    "amp": amp.state_dict()}, "%s/amp_epoch_%d.pth" % (opt.outf, epoch))
    return history


if __name__ == "__main__":
    main()
