"""The command lines a new user runs first (the benchmarks and the examples) refuse values
that would otherwise produce a silently wrong result, or fail only after the run: a batch,
image size or width of 0 (a table of nan losses and 0 samples/s, written as JSON with exit
status 0), a transformer sequence longer than its positional table, a negative gradient
clip (the FSDP2 example then trains uphill), a static loss scale of 0 or inf (the older
ImageNet scripts trained and checkpointed a nan model), --optimizer without --model
(ignored), an --out that is a file or a bare file name (the run finished, then crashed
writing its report). Also: the host-overhead benchmark's LARC cases step with LARC's
current planning signature, and profile_step checks its configuration names before the
first runs and exits non-zero when one failed. Every check calls a script's argument
parser or main() in this process with tiny settings; nothing is timed."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import bf16_weights, opt_levels, profile_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _refused(parse, argv, capsys, *needles):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err + (e.value.code if isinstance(e.value.code, str) else "")
    for needle in needles:
        assert needle in err, err


# -- benchmarks/opt_levels.py ------------------------------------------------------------------
QUICK = ["--device", "cpu", "--workloads", "cnn-sgd", "--levels", "O0,torch-fp32"]


@pytest.mark.parametrize("flag", ["--batch-size", "--image-size"])
def test_opt_levels_refuses_an_empty_batch_or_image(flag, capsys):
    _refused(opt_levels.parse_args, QUICK + [flag, "0"], capsys, flag, "got 0")
    args = opt_levels.parse_args(QUICK + [flag, "1", "--threads", "0"])  # the least it takes
    assert args.workload_specs["cnn-sgd"][flag[2:].replace("-", "_")] == 1


@pytest.mark.parametrize("argv", [["--model", "transformer", "--image-size", "600"],
                                  ["--workloads", "transformer-adamw", "--image-size", "513"]])
def test_opt_levels_refuses_a_sequence_longer_than_the_transformers_positions(argv, capsys):
    _refused(opt_levels.parse_args, ["--device", "cpu"] + argv, capsys, "512")
    argv[-1] = "512"  # the longest it holds
    assert list(opt_levels.parse_args(["--device", "cpu"] + argv).workload_specs.values())[0][
        "image_size"] == 512


def test_opt_levels_refuses_negative_threads(capsys):
    _refused(opt_levels.parse_args, QUICK + ["--threads", "-1"], capsys, "--threads")


def test_opt_levels_refuses_an_optimizer_it_would_ignore(capsys):
    _refused(opt_levels.parse_args, QUICK + ["--optimizer", "adamw"], capsys, "--model")
    args = opt_levels.parse_args(["--device", "cpu", "--model", "small-cnn", "--optimizer",
                                  "adamw"])
    assert args.workload_specs["small-cnn-adamw"]["optimizer"] == "adamw"


def test_opt_levels_refuses_an_out_path_that_is_a_file_before_measuring(tmp_path, capsys):
    afile = tmp_path / "results.json"
    afile.write_text("")
    _refused(opt_levels.parse_args, QUICK + ["--out", str(afile)], capsys, "--out")


# -- benchmarks/bf16_weights.py ----------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--batch-size", "--width", "--steps"])
def test_bf16_weights_refuses_zero_sizes_and_steps(flag, capsys):
    _refused(bf16_weights.parse_args, ["--device", "cpu", flag, "0"], capsys, flag)


# -- benchmarks/host_overhead.py ---------------------------------------------------------------
@pytest.fixture
def host_overhead():
    """The module, imported here: it sets TRITON_INTERPRET=0 when imported (for its own
    process), which would put every later test of this process off the interpreter. The
    variable is put back as it was."""
    saved = os.environ.get("TRITON_INTERPRET")
    try:
        return importlib.import_module("benchmarks.host_overhead")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def test_host_overhead_larc_cases_step_with_larcs_planning_signature(host_overhead,
                                                                     monkeypatch):
    monkeypatch.setattr(host_overhead, "LARC_TENSORS", 2)
    monkeypatch.setattr(host_overhead, "LARC_NUMEL", 4)
    cases = dict(host_overhead._larc_cases())
    assert set(cases) == {"kept sweeps", "per-parameter rewrite"}
    for step in cases.values():
        step()  # (TypeError on the per-parameter rewrite: the whole LARC section failed)


def test_host_overhead_writes_its_report_to_a_bare_file_name(tmp_path):
    # (its own process: the recorder needs kernels imported without the interpreter)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--quick",
                           "--norms-only", "--out", "report.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "report.json").read_text())["quick"] is True


@pytest.mark.parametrize("flag,value", [("--rounds", "0"), ("--steps-per-round", "-1")])
def test_host_overhead_refuses_counts_below_one(host_overhead, flag, value, tmp_path,
                                                capsys):
    out = tmp_path / "report.json"
    _refused(host_overhead.main, ["--quick", flag, value, "--out", str(out)], capsys, flag)
    assert not out.exists()


# -- benchmarks/profile_step.py ---------------------------------------------------------------
PROFILE = ["--device", "cpu", "--workload", "cnn-sgd", "--warmup", "0", "--steps", "1",
           "--profiled-steps", "1", "--top", "1"]


@pytest.fixture
def failing_builds(monkeypatch):
    built = []

    def build(name, workload, device):
        built.append(name)
        raise RuntimeError("planted")
    monkeypatch.setattr(profile_step, "build", build)
    return built


def test_profile_step_exits_non_zero_when_a_configuration_failed(failing_builds, capsys):
    rc = profile_step.main(PROFILE + ["--configs", "O0"])
    assert failing_builds == ["O0"] and "== O0: failed: RuntimeError: planted" in \
        capsys.readouterr().out
    assert rc != 0  # (0 with an empty table: nothing said the run measured nothing)


@pytest.mark.parametrize("configs", ["O0,O9", ",", "O0,torch.amp+nn-norm"])
def test_profile_step_checks_every_configuration_before_the_first_runs(configs, failing_builds,
                                                                       capsys):
    with pytest.raises(SystemExit) as e:
        profile_step.main(PROFILE + ["--configs", configs])
    assert e.value.code not in (0, None)
    assert failing_builds == []


# -- examples/fsdp2/main.py --------------------------------------------------------------------
def _fsdp2_example():
    spec = importlib.util.spec_from_file_location(
        "fsdp2_example_main", os.path.join(EXAMPLES, "fsdp2", "main.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--clip", "-1"], ["--clip", "inf"], ["--batch-size", "0"],
                                  ["--seq", "0"]])
def test_fsdp2_example_refuses_a_negative_clip_and_empty_sizes(argv, capsys):
    example = _fsdp2_example()
    _refused(example.parse, argv, capsys, argv[0])
    assert example.parse(["--clip", "0"]).clip == 0  # (0: off)


# -- examples/imagenet (main.py, main_reducer.py: the legacy --static-loss-scale) ---------------
@pytest.mark.parametrize("scale", ["0", "inf", "-1", "nan"])
def test_imagenet_legacy_scripts_refuse_a_static_loss_scale_that_is_not_positive(
        scale, monkeypatch):
    pytest.importorskip("torchvision")
    monkeypatch.syspath_prepend(os.path.join(EXAMPLES, "imagenet"))
    cli = importlib.import_module("imagenet_cli")
    args = cli.legacy_fp16_parser("t").parse_args(
        ["--fp16", "--static-loss-scale", scale, "-b", "4", "--crop-size", "32",
         "--val-resize", "36", "--workers", "0", "DIR"])
    with pytest.raises(SystemExit) as e:
        cli.check_args(args)  # (before any model, data or checkpoint)
    assert "--static-loss-scale must be a finite number > 0" in str(e.value.code)
    args.static_loss_scale = 128.0
    cli.check_args(args)
