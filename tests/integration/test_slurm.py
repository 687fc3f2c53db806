"""scripts/slurm/run.sub on a real one-node Slurm (slurmctld + slurmd + munged on localhost,
configured by this test): two tasks train the tiny model with gloo, write the MLPerf log and a
checkpoint; a SIGTERM makes the job save, requeue itself and resume. Needs Debian's slurm-wlm
and munge (.ci/run installs them); skipped without them. The scripts' argument handling (no
value is ever evaluated) is checked with a recording stand-in for srun."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rnnt.run_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
needs_slurm = pytest.mark.skipif(
    any(shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists() for d in DAEMONS),
    reason="needs slurm-wlm and munge (apt-get install slurm-wlm munge)",
)


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """A running one-node cluster; yields the environment its commands need."""
    root = tmp_path_factory.mktemp("slurm")
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = munge / "socket"
    subprocess.run(
        [
            _tool("munged"),
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={munge / 'pid'}",
            f"--log-file={munge / 'log'}",
            f"--seed-file={munge / 'seed'}",
        ],
        check=True,
    )
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=rnnttest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([_tool("slurmctld"), "-f", str(conf), "-i"], check=True, env=env)
    subprocess.run([_tool("slurmd"), "-f", str(conf)], check=True, env=env)
    deadline = time.monotonic() + 60
    while "idle" not in _out(["sinfo", "-h", "-o", "%t"], env):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test cluster did not come up: {_out(['sinfo'], env)}")
        time.sleep(0.5)
    yield {"env": env, "root": root}
    subprocess.run(["scancel", "--user=root"], env=env, check=False)
    for pid_file in (root / "slurmd.pid", root / "slurmctld.pid", munge / "pid"):
        if pid_file.is_file():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def _out(cmd: list[str], env: dict) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True).stdout


def _job(job: str, env: dict) -> dict[str, str]:
    fields = _out(["scontrol", "show", "job", job, "--oneliner"], env).split()
    return dict(f.split("=", 1) for f in fields if "=" in f)


def _wait(job: str, env: dict, timeout: float = 400) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(job, env)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return info
        time.sleep(1)
    raise AssertionError(f"job {job} did not end: {_job(job, env)}")


def _slurmd_errors(root: Path) -> str:
    log = root / "log" / "slurmd.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return "\n".join(line for line in lines if "error" in line)[-3000:]


def _submit(slurm: dict, corpus: dict, out: Path, *extra: str) -> str:
    root = corpus["root"]
    sets = [
        f"data.dataset_dir={root}",
        f"data.train_manifests=[{root / 'train.jsonl'}]",
        f"data.val_manifests=[{root / 'dev.jsonl'}]",
        f"data.tokenizer={corpus['tokenizer']}",
        "data.backend=torch",
        "model.n_classes=21",
        "model.enc_n_hid=32",
        "model.pred_n_hid=16",
        "model.joint_n_hid=32",
        "training.batch_size=4",
        "training.seed=5",
        "training.log_frequency=1",
        "training.collective_timeout_s=60",
        "eval.batch_size=6",
        *extra,
    ]
    cmd = [
        "sbatch",
        "--parsable",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={out}.log",
        "scripts/slurm/run.sub",
        "configs/systems/cpu_tiny.yaml",
        "--device",
        "cpu",
    ]
    for value in sets:
        cmd += ["--set", value]
    env = {**slurm["env"], "OUTPUT_DIR": str(out)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip().split(";")[0]


@needs_slurm
@pytest.mark.slow
def test_a_job_trains_logs_and_checkpoints(slurm, corpus, tmp_path):
    out = tmp_path / "run"
    job = _submit(slurm, corpus, out, "training.epochs=1")
    _wait(job, slurm["env"])
    log = Path(f"{out}.log").read_text()
    assert "STARTING TIMING RUN" in log and "RESULT,RNN_SPEECH_RECOGNITION" in log, log[-3000:]
    mlperf = (out / "mlperf.log").read_text()
    assert mlperf.count('"key": "run_stop"') == 1 and '"key": "cache_clear"' in mlperf
    assert '"key": "global_batch_size", "value": 8' in mlperf  # 4 per task x 2 tasks
    checkpoints = [c for c in (out / "checkpoints").iterdir() if (c / "complete.json").is_file()]
    assert checkpoints and (checkpoints[0] / "rank1.pt").is_file()


def _wait_for_step(out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while True:
        done = (
            [r["step"] for r in read_metrics(metrics) if r["kind"] == "train"]
            if (metrics.is_file())
            else []
        )
        if max(done, default=0) >= step:
            return
        assert time.monotonic() < deadline, Path(f"{out}.log").read_text()[-3000:]
        time.sleep(0.5)


@needs_slurm
@pytest.mark.slow
@pytest.mark.parametrize(
    "interrupt",
    [
        # what --signal=USR1@N sends ahead of the time limit: run.sub requeues the job itself
        ["scancel", "--signal=USR1"],
        # Slurm requeueing a running job (as preemption does): SIGTERM first, then requeued
        ["scontrol", "requeue"],
    ],
    ids=["usr1", "sigterm"],
)
def test_an_interrupted_job_saves_requeues_and_resumes(slurm, corpus, tmp_path, interrupt):
    out = tmp_path / "run"
    env = slurm["env"]
    # long enough that the interrupt lands inside the run: a step takes about 30 ms here, and
    # 3 epochs of 4 steps could end before Slurm delivered the signal (a CI run did)
    extra = ("training.epochs=30", "training.target_wer=0", "training.save_every_epochs=0")
    job = _submit(slurm, corpus, out, *extra)
    _wait_for_step(out, 2)
    subprocess.run([*interrupt, job], env=env, check=True)
    # Slurm holds a requeued job about two minutes before it may start again; the test does
    # not need to wait for that
    deadline = time.monotonic() + 120
    while not (_job(job, env).get("JobState") == "PENDING" and _job(job, env)["Restarts"] == "1"):
        assert time.monotonic() < deadline, _job(job, env)
        time.sleep(0.5)
    # slurmd refuses a job whose credential is no newer than the revocation of its previous
    # run, comparing whole seconds ("Job credential revoked"): started within the second of
    # the requeue, the job fails without running
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    info = _wait(job, env, timeout=600)
    log = Path(f"{out}.log").read_text()
    assert int(info["Restarts"]) == 1, log[-3000:]
    assert info["StartTime"] != info["EndTime"], (info, _slurmd_errors(slurm["root"]))
    assert "preempted: state saved in" in log and "resumed from" in log, log[-3000:]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    # 30 epochs of 4 steps, each logged once: saved at a log point, resumed after it
    assert sorted(steps) == list(range(1, 121))


def test_no_argument_is_ever_evaluated(tmp_path):
    """run.sub and run_and_time.sh pass every value on as one word: a command substitution in
    a config path, an override or an image name never runs. A stand-in srun records what it
    was asked to run (the launch flags included) instead of running it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun_args"
    fake = bin_dir / "srun"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> "{record}"\n')
    fake.chmod(0o755)
    planted = tmp_path / "pwned"
    evil = f"$(touch {planted})"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "",
        "CONTAINER_IMAGE": f"img{evil}",
        "DATASETS": f"/data/{evil}",
        "OUTPUT_DIR": str(tmp_path / "out"),
    }
    proc = subprocess.run(
        ["bash", "scripts/slurm/run.sub", f"configs/{evil}.yaml", "--set", f"a.b={evil}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().splitlines()
    assert f"--container-image=img{evil}" in args
    assert any(a.startswith("--container-mounts=") and evil in a for a in args)
    assert f"configs/{evil}.yaml" in args and f"a.b={evil}" in args
    proc = subprocess.run(
        ["bash", "scripts/run_and_time.sh", f"configs/{evil}.yaml"],
        cwd=ROOT,
        env={**env, "SEED": f"1{evil}"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "SEED must be a non-negative integer" in proc.stderr
    assert not planted.exists()
