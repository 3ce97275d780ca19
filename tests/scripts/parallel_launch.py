"""Launch the multi-process worlds of the tritamp.parallel tests, once per test session.

Starting a rank costs seconds (importing torch), so each world is launched once and every
test that needs it reads its results: the 2-rank world (``torch.distributed.run``) runs
the SyncBatchNorm cases of ``CASES_2``, the ResNet-18 comparison and the Reducer checks;
the 3-rank world (started directly with a file:// rendezvous) runs ``CASES_3``. Both
start when the first is asked for. Results land in a pytest temporary folder as
``<name>.rank<r>.pt``.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "syncbn_worker.py")
TIMEOUT = 300

# SyncBatchNorm cases (keys: see syncbn_worker.make_data). "interpret": the Triton kernels
# run in Triton's interpreter inside the ranks; otherwise the torch reference path runs.
CASES_2 = [
    dict(name="w2_nchw_fp32", batches=[3, 5], channels=4, spatial=[3, 3], dtype="float32",
         layout="nchw", steps=2, interpret=True),
    dict(name="w2_channels_last_fp16", batches=[2, 5], channels=5, spatial=[2, 3],
         dtype="float16", layout="channels_last", steps=2, interpret=True),
    dict(name="w2_apex_channel_last_z_relu", batches=[3, 2], channels=3, spatial=[4],
         dtype="float32", layout="apex_last", steps=2, interpret=True, z=True, fuse_relu=True),
    # rank 0 holds one value per channel: allowed, the group's batch has six
    dict(name="w2_2d_cumulative_momentum", batches=[1, 5], channels=6, spatial=[],
         dtype="float32", layout="nchw", steps=2, interpret=True, momentum=None),
    # process groups from create_syncbn_process_group: the world, then one group per rank
    dict(name="w2_group_of_two", batches=[2, 3], channels=3, spatial=[2, 2], dtype="float32",
         layout="nchw", steps=2, group_size=2),
    dict(name="w2_groups_of_one", batches=[2, 3], channels=3, spatial=[2, 2], dtype="float32",
         layout="channels_last", steps=2, group_size=1),
    # every rank empty: no statistics anywhere, the running ones stay (both paths)
    dict(name="w2_all_empty", batches=[0, 0], channels=3, spatial=[2, 2], dtype="float32",
         layout="nchw", steps=2, interpret=True),
    dict(name="w2_all_empty_cpu_path", batches=[0, 0], channels=3, spatial=[2, 2],
         dtype="float32", layout="channels_last", steps=2, momentum=None),
]
CASES_3 = [
    dict(name="w3_nchw_fp32", batches=[1, 4, 2], channels=6, spatial=[2, 3], dtype="float32",
         layout="nchw", steps=2),
    dict(name="w3_channels_last_fp16", batches=[2, 3, 4], channels=4, spatial=[3, 2],
         dtype="float16", layout="channels_last", steps=2, interpret=True),
    dict(name="w3_channels_last_fp32", batches=[4, 1, 3], channels=5, spatial=[2, 2],
         dtype="float32", layout="channels_last", steps=2),
    dict(name="w3_empty_rank", batches=[0, 3, 2], channels=3, spatial=[2, 2], dtype="float32",
         layout="nchw", steps=2, interpret=True),
    dict(name="w3_5d_channels_last_bf16", batches=[2, 1, 1], channels=3, spatial=[2, 2, 2],
         dtype="bfloat16", layout="channels_last", steps=2),
    dict(name="w3_no_affine_fp16", batches=[3, 2, 2], channels=4, spatial=[5], dtype="float16",
         layout="nchw", steps=2, affine=False),
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the worker decides per case
    return env


def _write_cases(out, cases):
    path = os.path.join(str(out), "cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    return path


class _World:
    """Rank processes running in the background; ``wait`` collects them once."""

    def __init__(self, name, out, commands):
        self.name, self.out = name, out
        self.procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=_env()) for cmd in commands]
        self.error = None
        self.done = False

    def wait(self):
        if not self.done:
            try:
                logs = [p.communicate(timeout=TIMEOUT)[0] for p in self.procs]
                if any(p.returncode != 0 for p in self.procs):
                    self.error = f"{self.name} failed:\n" + "\n".join(logs)[-6000:]
            finally:
                for p in self.procs:
                    p.kill()
                self.done = True
        if self.error:
            raise RuntimeError(self.error)
        return self.out


def _start_world2(tmp_path_factory):
    """2 ranks under torch.distributed.run: CASES_2, the ResNet-18 run, the Reducer checks."""
    out = tmp_path_factory.mktemp("world2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           WORKER, "--out", str(out), "--cases", _write_cases(out, CASES_2), "--resnet",
           "--reducer"]
    return _World("torchrun world of 2", out, [cmd])


def _start_world3(tmp_path_factory):
    """3 ranks started directly with a file:// rendezvous (no port to pick): CASES_3."""
    out = tmp_path_factory.mktemp("world3")
    cases = _write_cases(out, CASES_3)
    init = os.path.join(str(out), "rendezvous")
    return _World("world of 3", out, [
        [sys.executable, WORKER, "--out", str(out), "--cases", cases, "--init-file", init,
         "--rank", str(r), "--world-size", "3"] for r in range(3)])


_worlds = {}  # this test session's worlds


def _start_all(tmp_path_factory):
    # Both worlds start together: their processes overlap (imports, waits on each other),
    # which takes less time than one world after the other.
    if not _worlds:
        _worlds["world2"] = _start_world2(tmp_path_factory)
        _worlds["world3"] = _start_world3(tmp_path_factory)


def world2(tmp_path_factory):
    """The 2-rank world's results folder (launched on first use, with the 3-rank world)."""
    _start_all(tmp_path_factory)
    return _worlds["world2"].wait()


def world3(tmp_path_factory):
    """The 3-rank world's results folder (launched on first use, with the 2-rank world)."""
    _start_all(tmp_path_factory)
    return _worlds["world3"].wait()
