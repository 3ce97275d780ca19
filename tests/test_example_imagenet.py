"""The ImageNet examples (examples/imagenet) end to end on a tiny generated ImageFolder, on CPU.

Most runs call the scripts' ``main(argv)`` in this process (importing torch and
torchvision once keeps the file quick); two go through ``torchrun`` with two gloo
processes. The examples train on torch's CPU
reference path (TRITON_INTERPRET=0): a ResNet step under Triton's interpreter takes tens
of seconds, and the kernels themselves are tested under the interpreter elsewhere.
"""
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("torchvision", reason="the ImageNet examples need torchvision "
                                          "(pip install -e '.[examples]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "imagenet")
SMALL = ["-a", "resnet18", "-b", "4", "--crop-size", "32", "--val-resize", "36", "--workers", "0",
         "-p", "1"]
ITERS = 4            # 2 classes x 8 training images, batch 4
LINE_RE = re.compile(
    r"^Epoch: \[(\d+)\]\[(\d+)/(\d+)\]\tTime \d+\.\d{3} \(\d+\.\d{3}\)\t"
    r"Speed \d+\.\d{3} \(\d+\.\d{3}\)\tLoss (\S+) \((\S+)\)\t"
    r"Prec@1 (\d+\.\d{3}) \(\d+\.\d{3}\)\tPrec@5 (\d+\.\d{3}) \(\d+\.\d{3}\)$", re.M)
FINAL_RE = re.compile(r"^ \* Prec@1 (\d+\.\d{3}) Prec@5 (\d+\.\d{3})$", re.M)

_modules = {}


def _example(name):
    """A script of examples/imagenet as a module (under a name of its own: ``main`` is
    common). Its folder is on sys.path only while it loads, as it is for a script."""
    if name not in _modules:
        sys.path.insert(0, EXAMPLES)
        try:
            if name.startswith("imagenet_"):
                module = importlib.import_module(name)       # the scripts' shared modules
            else:
                spec = importlib.util.spec_from_file_location(
                    f"imagenet_example_{name}", os.path.join(EXAMPLES, name + ".py"))
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
        finally:
            sys.path.remove(EXAMPLES)
        _modules[name] = module
    return _modules[name]


@contextlib.contextmanager
def _example_process_state():
    """What a script may change for its process, put back afterwards: the examples set
    seeds, determinism flags and print options as a training script does."""
    env_keys = ("TRITON_INTERPRET", "CUBLAS_WORKSPACE_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    env = {k: os.environ.get(k) for k in env_keys}
    rng = torch.get_rng_state()
    det = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    # One intra-op thread, as in the torchrun workers: OpenMP's spinning barriers turn a
    # busy shared CPU into ten-fold slowdowns.
    torch.set_num_threads(1)
    os.environ["TRITON_INTERPRET"] = "0"
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(det[0], warn_only=det[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        torch.set_printoptions(profile="default")
        torch.set_num_threads(threads)


def run(name, argv):
    """``examples/imagenet/<name>.py`` in this process: (return value, stdout)."""
    out = io.StringIO()
    with _example_process_state(), contextlib.redirect_stdout(out):
        result = _example(name).main([str(a) for a in argv])
    return result, out.getvalue()


def _subprocess_env():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


# Runs an example under torchrun and saves each rank's final model state as rank<N>.pt,
# so the test can check that the processes stayed in step.
_RANK_STATES = """
import sys
import torch
sys.path.insert(0, {examples!r})
from imagenet_model import unwrap
import {script} as script
_fit = script.fit
def fit(args, model, *a, **kw):
    result = _fit(args, model, *a, **kw)
    torch.save(unwrap(model).state_dict(), "rank%d.pt" % args.rank)
    return result
script.fit = fit
script.main(sys.argv[1:])
"""


def _torchrun(script, argv, tmp_path):
    """Two gloo processes; returns (stdout, [rank 0 state, rank 1 state])."""
    wrapper = tmp_path / "run_example.py"
    wrapper.write_text(_RANK_STATES.format(examples=EXAMPLES, script=script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(wrapper)] + [str(a) for a in argv]
    p = subprocess.run(cmd, cwd=tmp_path, env=_subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, [load(tmp_path / f"rank{r}.pt") for r in range(2)]


def load(path):
    return torch.load(path, weights_only=True)


def assert_same(a, b, where="checkpoint"):
    """Bitwise equality of nested checkpoint contents."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_training_output(out, epochs=(0,), iters=ITERS):
    """Apex's per-iteration line for every iteration (-p 1) and the final line per epoch."""
    lines = LINE_RE.findall(out)
    assert [(int(e), int(i), int(n)) for e, i, n, *_ in lines] == \
        [(e, i, iters) for e in epochs for i in range(1, iters + 1)], out
    for *_, loss, loss_avg, prec1, prec5 in lines:
        assert math.isfinite(float(loss)) and len(loss.split(".")[1]) == 10
        assert 0.0 <= float(prec1) <= float(prec5) <= 100.0
    finals = FINAL_RE.findall(out)
    assert len(finals) == len(epochs), out
    return [float(p1) for p1, _ in finals]


def check_checkpoint(folder, epoch, arch="resnet18", iters=ITERS, world_size=1):
    ck = load(os.path.join(folder, "checkpoint.pth.tar"))
    assert ck["epoch"] == epoch and ck["arch"] == arch
    assert len(ck["rng"]) == world_size
    # The last step's learning rate: 0.1 scaled by the global batch / 256, warmup by step.
    learning_rate = _example("imagenet_model").learning_rate
    lr = learning_rate(0.1 * 4 * world_size / 256., epoch - 1, iters - 1, iters)
    opt = ck["optimizer"]
    opt = opt.get("optimizer_state_dict", opt)          # FP16_Optimizer wraps torch's
    assert [g["lr"] for g in opt["param_groups"]] == [lr]
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    return ck


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    make = _example("make_tiny_imagenet")
    return make.make_tiny_imagenet(str(tmp_path_factory.mktemp("tiny-imagenet")))


# ------------------------------------------------------------------------- main_amp

@pytest.mark.parametrize("extra", [
    ["--opt-level", "O0"],
    ["--opt-level", "O1", "--half-dtype", "bf16"],
    ["--opt-level", "O3", "--half-dtype", "bf16", "--keep-batchnorm-fp32", "True",
     "--channels-last"],
], ids=["O0", "O1-bf16", "O3-bf16-bn32-channels-last"])
def test_main_amp_opt_levels(extra, data, tmp_path):
    best, out = run("main_amp", SMALL + extra + ["--epochs", 1, "--output-dir", tmp_path, data])
    assert out.startswith(f"opt_level = {extra[1]}\n")
    (prec1,) = check_training_output(out)
    assert best == prec1
    ck = check_checkpoint(tmp_path, epoch=1)
    assert ck["best_prec1"] == prec1
    assert set(ck["amp"]) == {"loss_scaler0"}
    assert ck["amp"]["loss_scaler0"]["loss_scale"] == 1.0       # O0, and bf16 at O1/O3
    floats = {k: v for k, v in ck["state_dict"].items() if v.is_floating_point()}
    assert all(v.dtype == torch.float32 for v in floats.values())
    # The first epoch is the best so far: model_best is the same file.
    with open(os.path.join(tmp_path, "checkpoint.pth.tar"), "rb") as a, \
            open(os.path.join(tmp_path, "model_best.pth.tar"), "rb") as b:
        assert a.read() == b.read()
    conv = ck["state_dict"]["conv1.weight"]
    channels_last = "--channels-last" in extra
    assert conv.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert conv.is_contiguous() == (not channels_last)


def test_main_amp_fp16_dynamic_loss_scale(data, tmp_path):
    # fp16 arithmetic on a CPU is slow; a small network keeps this run short. Seeded: a
    # rare random initialisation overflows fp16 in the forward pass already.
    best, out = run("main_amp", ["-a", "mobilenet_v3_small"] + SMALL[2:] + [
        "--opt-level", "O2", "--deterministic", "--epochs", 1, "--output-dir", tmp_path, data])
    check_training_output(out)
    ck = check_checkpoint(tmp_path, epoch=1, arch="mobilenet_v3_small")
    scaler = ck["amp"]["loss_scaler0"]
    assert scaler["dynamic"] is True
    # 2**16 at the start; only overflows may lower it, each skipping one of the 4 steps.
    skipped = round(math.log2(65536.0 / scaler["loss_scale"]))
    assert 65536.0 / 2 ** skipped == scaler["loss_scale"] and 0 <= skipped < ITERS
    # Clean steps since the last overflow (Apex's counter restarts at an overflow).
    assert skipped + scaler["unskipped"] <= ITERS
    assert skipped > 0 or scaler["unskipped"] == ITERS
    assert all(v.dtype == torch.float32 for v in ck["state_dict"].values() if v.is_floating_point())


O2_DET = SMALL + ["--opt-level", "O2", "--half-dtype", "bf16", "--loss-scale", "dynamic",
                  "--deterministic"]


@pytest.fixture(scope="module")
def o2_runs(data, tmp_path_factory):
    """2 epochs straight; 1 epoch, then --resume for the second."""
    straight = tmp_path_factory.mktemp("straight")
    parts = tmp_path_factory.mktemp("parts")
    _, out_straight = run("main_amp", O2_DET + ["--epochs", 2, "--output-dir", straight, data])
    _, out_first = run("main_amp", O2_DET + ["--epochs", 1, "--output-dir", parts, data])
    first = load(os.path.join(parts, "checkpoint.pth.tar"))
    _, out_resumed = run("main_amp", O2_DET + ["--epochs", 2, "--output-dir", parts, "--resume",
                                               os.path.join(parts, "checkpoint.pth.tar"), data])
    return dict(straight=straight, parts=parts, first=first, out_straight=out_straight,
                out_first=out_first, out_resumed=out_resumed)


def _facts(lines):
    """Loss and precision columns (not the timings) of the per-iteration lines."""
    return [(e, i, loss, prec1, prec5) for e, i, n, loss, _, prec1, prec5 in lines]


def test_resume_continues_bitwise_identically(o2_runs):
    check_training_output(o2_runs["out_straight"], epochs=(0, 1))
    check_training_output(o2_runs["out_first"], epochs=(0,))
    check_training_output(o2_runs["out_resumed"], epochs=(1,))
    assert "=> loaded checkpoint" in o2_runs["out_resumed"]
    straight = check_checkpoint(o2_runs["straight"], epoch=2)
    resumed = check_checkpoint(o2_runs["parts"], epoch=2)
    assert_same(straight, resumed)
    # The epoch the resumed run trained printed the same losses and precisions.
    assert _facts(LINE_RE.findall(o2_runs["out_resumed"])) == \
        _facts(LINE_RE.findall(o2_runs["out_straight"]))[ITERS:]
    # ... and the state really moved on from the first epoch's checkpoint.
    first = o2_runs["first"]
    assert first["epoch"] == 1
    assert not torch.equal(first["state_dict"]["fc.weight"], resumed["state_dict"]["fc.weight"])
    assert resumed["amp"]["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 2 * ITERS,
                                              "hysteresis": 1, "dynamic": True, "skipped": 0,
                                              "floor_streak": 0, "floor_warned": False}


def test_deterministic_runs_are_bitwise_identical(o2_runs, data, tmp_path):
    """A second run of the 1-epoch --deterministic O2 run of the resume test."""
    _, out = run("main_amp", O2_DET + ["--epochs", 1, "--output-dir", tmp_path, data])
    assert _facts(LINE_RE.findall(out)) == _facts(LINE_RE.findall(o2_runs["out_first"]))
    assert_same(load(tmp_path / "checkpoint.pth.tar"), o2_runs["first"])


def test_evaluate_reports_the_checkpoint_s_precision(o2_runs, data):
    ckpt = os.path.join(o2_runs["parts"], "checkpoint.pth.tar")
    best, out = run("main_amp", O2_DET + ["-e", "--resume", ckpt, data])
    assert not LINE_RE.findall(out)
    assert FINAL_RE.findall(out) == FINAL_RE.findall(o2_runs["out_resumed"])
    assert best == float(FINAL_RE.findall(out)[0][0])


def test_two_processes_with_torchrun(data, tmp_path):
    argv = SMALL + ["--opt-level", "O2", "--half-dtype", "bf16", "--sync_bn", "--epochs", 1,
                    "--deterministic", data]
    out, ranks = _torchrun("main_amp", argv, tmp_path)
    assert out.count("opt_level = O2") == 1                  # rank 0 prints, once
    assert out.count("=> creating model") == 1
    assert "device = cpu, world_size = 2" in out
    assert "using tritamp synced BN" in out
    check_training_output(out, iters=ITERS // 2)             # the batches are split over ranks
    ck = check_checkpoint(tmp_path, epoch=1, iters=ITERS // 2, world_size=2)
    assert not any(k.startswith("module.") for k in ck["state_dict"])
    assert not torch.equal(ck["rng"][0]["cpu"], ck["rng"][1]["cpu"])   # seeded per rank
    # Both processes end with the same fp32 master weights and (synced) BatchNorm statistics,
    # though each was seeded differently: rank 0's initial weights reached rank 1 before amp
    # made its masters.
    assert_same(ranks[0], ranks[1], "rank 0 vs rank 1")
    assert_same(ranks[0], ck["state_dict"], "rank 0 vs checkpoint")


# ---------------------------------------------------------------- the older scripts

@pytest.mark.parametrize("script,extra", [
    ("main", []),
    ("main", ["--fp16", "--half-dtype", "bf16", "--static-loss-scale", "128"]),
    ("main_fp16_optimizer", ["--fp16", "--half-dtype", "bf16", "--static-loss-scale", "128"]),
    ("main_fp16_optimizer", ["--fp16", "--half-dtype", "bf16", "--dynamic-loss-scale"]),
    ("main_reducer", ["--static-loss-scale", "1024"]),
], ids=["main-fp32", "main-fp16-static", "fp16_optimizer-static", "fp16_optimizer-dynamic",
        "reducer-fp32-scale"])
def test_older_scripts(script, extra, data, tmp_path):
    best, out = run(script, SMALL + extra + ["--epochs", 1, "--output-dir", tmp_path, data])
    (prec1,) = check_training_output(out)
    assert best == prec1
    if "--fp16" not in extra and "--static-loss-scale" in extra:
        # divided out only with --fp16: reset, as main.py does (main_reducer.py trained on
        # gradients 1024x too large)
        assert "Resetting static_loss_scale to 1.0" in out
    ck = check_checkpoint(tmp_path, epoch=1)
    sd = ck["state_dict"]
    if "--fp16" not in extra:
        assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
        return
    # network_to_half: a Sequential(cast, model) in bf16 with fp32 BatchNorm.
    assert sd["1.conv1.weight"].dtype == torch.bfloat16 and sd["1.bn1.weight"].dtype == torch.float32
    if script == "main":
        masters = ck["master_params"]
    else:
        opt = ck["optimizer"]
        masters = [m for group in opt["fp32_from_fp16"] for m in group]
        assert opt["dynamic_loss_scale"] == ("--dynamic-loss-scale" in extra)
        scale = opt["loss_scaler"]["loss_scale"]
        assert scale == (65536.0 if "--dynamic-loss-scale" in extra else 128.0)
    # The half model is the fp32 masters rounded, after the last step. main.py keeps a
    # master of every parameter; FP16_Optimizer of the half ones (fp32 BatchNorm
    # parameters are updated in place).
    params = [k for k, v in sd.items() if v.is_floating_point() and not
              any(k.endswith(s) for s in ("running_mean", "running_var"))]
    if script == "main_fp16_optimizer":
        params = [k for k in params if sd[k].dtype == torch.bfloat16]
    assert len(masters) == len(params)
    for k, m in zip(params, masters):
        assert m.dtype == torch.float32
        assert torch.equal(sd[k], m.to(sd[k].dtype)), k


def test_main_reducer_two_processes(data, tmp_path):
    argv = SMALL + ["--fp16", "--half-dtype", "bf16", "--epochs", 1, data]
    out, ranks = _torchrun("main_reducer", argv, tmp_path)
    check_training_output(out, iters=ITERS // 2)
    ck = check_checkpoint(tmp_path, epoch=1, iters=ITERS // 2, world_size=2)
    assert all(m.dtype == torch.float32 for m in ck["master_params"])
    # Reducer broadcast rank 0's weights and averaged every gradient: the parameters agree.
    # (It leaves buffers alone: each rank's BatchNorm statistics are its own, as in Apex.)
    params = [k for k in ranks[0] if not k.endswith(("running_mean", "running_var",
                                                      "num_batches_tracked"))]
    assert_same({k: ranks[0][k] for k in params}, {k: ranks[1][k] for k in params})
    assert not torch.equal(ranks[0]["1.bn1.running_mean"], ranks[1]["1.bn1.running_mean"])


# --------------------------------------------------------------- options and helpers

def test_prof_writes_a_trace_of_the_profiled_iterations_and_stops(data, tmp_path):
    _, out = run("main_amp", SMALL + ["--opt-level", "O0", "--prof", 2, "--output-dir", tmp_path,
                                      data])
    assert "Profiling begun at iteration 2" in out
    trace = tmp_path / "trace_rank0.json"
    assert f"Profiling ended at iteration {ITERS} (the epoch ended first); trace written to " \
           f"{trace}" in out
    assert not FINAL_RE.findall(out) and not (tmp_path / "checkpoint.pth.tar").exists()
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"Body of iteration 2", f"Body of iteration {ITERS}", "forward",
            "backward and optimizer.step()"} <= names
    assert "Body of iteration 1" not in names


def test_pretrained_without_network_fails_fast_and_clearly(data, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))     # nothing cached
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")                 # nothing listens there
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)   # re-read the proxy settings
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        run("main_amp", SMALL + ["--opt-level", "O0", "--pretrained", data])
    assert time.monotonic() - start < 30
    msg = str(e.value.code)
    assert msg.startswith("--pretrained: the resnet18 weights are not cached")
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in msg
    assert os.path.join(str(tmp_path / "torch-home"), "hub", "checkpoints",
                        "resnet18-f37072fd.pth") in msg
    assert "without --pretrained" in msg


@pytest.mark.parametrize("argv,message", [
    (["--epochs", 1, "{missing}"], "is not a directory: DIR must hold train/ and val/"),
    (["--resume", "{missing}", "{data}"], "=> no checkpoint found at"),
    (["--prof", 9, "{data}"], "--prof 9: an epoch has only 4 iterations"),
    (["--crop-size", 32, "--val-resize", 30, "{data}"], "--val-resize (30) must be at least"),
], ids=["no-data", "no-checkpoint", "prof-too-late", "val-resize"])
def test_bad_input_exits_with_the_fix(argv, message, data, tmp_path):
    argv = [str(a).format(missing=tmp_path / "missing", data=data) for a in argv]
    with pytest.raises(SystemExit) as e:
        run("main_amp", SMALL + ["--opt-level", "O0", "--output-dir", tmp_path] + argv)
    assert message in str(e.value.code)


def test_channels_last_is_an_on_off_flag():
    parse = _example("main_amp").parse
    base = ["DIR", "--opt-level", "O2"]
    assert parse(base).channels_last is False
    assert parse(base + ["--channels-last"]).channels_last is True
    assert parse(["--channels-last", "True"] + base).channels_last is True
    assert parse(["--channels-last", "False"] + base).channels_last is False
    assert parse(["--channels-last=no"] + base).channels_last is False
    # Alone before the data folder, it does not take the folder for its value.
    args = parse(["--opt-level", "O2", "--channels-last", "/data/imagenet"])
    assert args.channels_last is True and args.data == "/data/imagenet"
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        parse(["--channels-last=maybe"] + base)
    assert "expected True or False, got 'maybe'" in err.getvalue()
    args = parse(base)          # Apex's defaults
    assert (args.crop_size, args.val_resize, args.batch_size, args.lr, args.momentum,
            args.weight_decay, args.print_freq, args.epochs, args.workers, args.prof) == \
        (224, 256, 256, 0.1, 0.9, 1e-4, 10, 90, 4, -1)


def test_learning_rate_schedule():
    lr = _example("imagenet_model").learning_rate
    base, n = 0.4, 10
    warmup = [lr(base, e, s, n) for e in range(5) for s in range(n)]
    assert warmup == [base * (k + 1) / (5. * n) for k in range(5 * n)]
    assert warmup[-1] == base
    assert [lr(base, e, 0, n) for e in (5, 29, 30, 59, 60, 79, 80, 89)] == \
        [base, base, base * 0.1, base * 0.1, base * 0.1 ** 2, base * 0.1 ** 2, base * 0.1 ** 3,
         base * 0.1 ** 3]


def test_checkpoint_writes_are_atomic(tmp_path):
    checkpoints = _example("imagenet_checkpoint")
    checkpoints.save_checkpoint({"epoch": 1}, is_best=True, directory=str(tmp_path))
    path = tmp_path / "checkpoint.pth.tar"
    before = path.read_bytes()

    def interrupted(f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints._atomic_write(str(path), interrupted)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth.tar", "model_best.pth.tar"]
    assert load(tmp_path / "model_best.pth.tar") == {"epoch": 1}
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_progress_bar_only_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    metrics = _example("imagenet_metrics")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for tty in (True, False):
        out = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        bar = metrics.Progress(3, "Epoch 0", enabled=True)
        bar.write("a line")
        bar.update()
        bar.close()
        text = out.getvalue()
        assert "a line\n" in text
        assert ("Epoch 0:" in text) == tty
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    quiet = metrics.Progress(3, "Epoch 0", enabled=False)           # ranks other than 0
    quiet.write("a line")
    assert sys.stdout.getvalue() == ""


def test_make_tiny_imagenet_is_reproducible(tmp_path):
    make = _example("make_tiny_imagenet").make_tiny_imagenet
    a, b = make(str(tmp_path / "a"), classes=3, train_per_class=2, val_per_class=1), \
        make(str(tmp_path / "b"), classes=3, train_per_class=2, val_per_class=1)
    files = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    assert len(files) == 9 and files[0] == os.path.join("train", "n00000000", "train_0000.JPEG")
    for f in files:
        with open(os.path.join(a, f), "rb") as x, open(os.path.join(b, f), "rb") as y:
            assert x.read() == y.read()


def test_distributed_validation_counts_every_image_once(tmp_path):
    """9 validation images over 2 processes: torch's DistributedSampler pads rank 1's share
    with a repeat of image 0, which the metrics counted twice (4/10 where one process
    saw 3/9). Evaluating one checkpoint with one process and with two gives the same
    Prec@1, Prec@5 and loss."""
    make = _example("make_tiny_imagenet").make_tiny_imagenet
    odd = make(str(tmp_path / "odd"), classes=3, train_per_class=4, val_per_class=3)
    common = SMALL + ["--opt-level", "O0", "--deterministic"]
    run("main_amp", common + ["--epochs", 1, "--output-dir", tmp_path / "train", odd])
    ckpt = tmp_path / "train" / "checkpoint.pth.tar"
    evaluate = common + ["-e", "--resume", ckpt, odd]
    _, one = run("main_amp", evaluate)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(EXAMPLES, "main_amp.py")] + [str(a) for a in evaluate]
    p = subprocess.run(cmd, cwd=tmp_path, env=_subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (want,), (got,) = FINAL_RE.findall(one), FINAL_RE.findall(p.stdout)
    assert got == want
    k = float(want[0]) * 9 / 100  # (Prec@1 is k / 9, printed to 3 decimals)
    assert k == pytest.approx(round(k), abs=1e-3)
