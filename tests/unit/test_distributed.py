"""Process setup (rnnt/distributed.py): the launchers' environments."""

import os

import pytest

from rnnt.distributed import _launcher_env, first_slurm_host


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("dgx01", "dgx01"),
        ("dgx[03-05,09]", "dgx03"),
        ("dgx[7,9],login1", "dgx7"),
        ("node-a[001-004]", "node-a001"),
        ("a,b", "a"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_torchrun_variables_win_over_slurms(monkeypatch):
    for key, value in dict(
        RANK="3",
        WORLD_SIZE="8",
        LOCAL_RANK="3",
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
    ).items():
        monkeypatch.setenv(key, value)
    assert _launcher_env() == (3, 8, 3)


def test_srun_tasks_rendezvous_at_the_first_node(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    srun = dict(
        SLURM_PROCID="5",
        SLURM_NTASKS="16",
        SLURM_LOCALID="5",
        SLURM_STEP_NODELIST="gpu[12-13]",
        SLURM_JOB_ID="4242",
    )
    for key, value in srun.items():
        monkeypatch.setenv(key, value)
    assert _launcher_env() == (5, 16, 5)
    assert os.environ["MASTER_ADDR"] == "gpu12"
    assert os.environ["MASTER_PORT"] == str(29500 + 4242 % 20000)


def test_one_process_without_a_launcher(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    assert _launcher_env() == (0, 1, 0)


def test_jobs_on_part_of_a_nodes_gpus_take_that_part_of_its_cores(tmp_path):
    """Four one-GPU runs on a 4-GPU, 64-core host each saw all 64 cores in their affinity and
    asked for 56 intra-op threads; each one's share is a quarter of the node."""
    from rnnt.distributed import torch_threads, visible_gpu_share

    proc = tmp_path / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"):
        (proc / bus).mkdir(parents=True)
    assert visible_gpu_share({"CUDA_VISIBLE_DEVICES": "2"}, proc) == (1, 4)
    assert visible_gpu_share({"CUDA_VISIBLE_DEVICES": "0,1"}, proc) == (2, 4)
    visible, on_node = visible_gpu_share({"CUDA_VISIBLE_DEVICES": "3"}, proc)
    assert torch_threads(64 * visible // on_node, 1, 14, 0) == 2
    # all of them, none named, or a machine without the NVIDIA driver: the whole node
    assert visible_gpu_share({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, proc) == (1, 1)
    assert visible_gpu_share({}, proc) == (1, 1)
    assert visible_gpu_share({"CUDA_VISIBLE_DEVICES": "2"}, tmp_path / "absent") == (1, 1)
    # hiding every GPU is a CPU run of the whole machine
    assert visible_gpu_share({"CUDA_VISIBLE_DEVICES": ""}, proc) == (1, 1)


def test_torch_threads_share_the_cores_with_the_loader_and_other_ranks():
    from rnnt.distributed import torch_threads

    assert torch_threads(cores=2, local_ranks=1, data_threads=2, setting=0) == 1  # at least 1
    assert torch_threads(cores=16, local_ranks=1, data_threads=4, setting=0) == 12
    assert torch_threads(cores=128, local_ranks=8, data_threads=4, setting=0) == 12
    assert torch_threads(cores=128, local_ranks=8, data_threads=4, setting=3) == 3  # the setting


@pytest.fixture
def threads_line(monkeypatch, tmp_path):
    """set_torch_threads on one rank, without loader threads, on a node of four GPUs of which
    CUDA_VISIBLE_DEVICES names `visible`, in an affinity of `machine_share` of the machine:
    returns (the threads it set, its line); torch's setting is restored after the test."""
    import torch

    from rnnt import distributed

    for bus in ("a", "b", "c", "d"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(distributed, "NVIDIA_PROC_GPUS", tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    before = torch.get_num_threads()

    def run(visible: str | None, machine_share: int = 1) -> tuple[int, str]:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        cores = distributed.available_cores()
        monkeypatch.setattr(distributed.os, "cpu_count", lambda: machine_share * cores)
        line = distributed.set_torch_threads(data_threads=0, setting=0)
        return torch.get_num_threads(), line

    yield run
    torch.set_num_threads(before)


def test_the_choice_is_applied_and_said(threads_line):
    from rnnt.distributed import available_cores

    cores = available_cores()
    assert threads_line(None) == (
        cores,
        f"torch intra-op threads: {cores} ({cores} cores / 1 rank(s) on this node - 0 "
        "data.num_threads)",
    )


def test_a_job_on_part_of_the_nodes_gpus_says_so(threads_line):
    from rnnt.distributed import available_cores

    cores = available_cores()
    share = max(1, cores // 4)
    assert threads_line("1") == (
        share,
        f"torch intra-op threads: {share} ({cores} cores x 1/4 of the node's GPUs / 1 rank(s) "
        "on this node - 0 data.num_threads)",
    )


def test_an_affinity_that_split_the_node_already_is_not_split_again(threads_line):
    from rnnt.distributed import available_cores

    threads, line = threads_line("1", machine_share=4)
    assert threads == available_cores() and "of the node's GPUs" not in line


def test_ranks_share_an_affinity_only_where_they_inherit_it():
    from rnnt.distributed import ranks_sharing_cores

    # torchrun's children share their launcher's cores, narrowed or not
    assert ranks_sharing_cores({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "1"}, True) == 8
    assert ranks_sharing_cores({"LOCAL_WORLD_SIZE": "4"}, False) == 4
    # srun's tasks (run.sub: 8 per node, 14 cores each): bound, each has its own cores
    assert ranks_sharing_cores({"SLURM_NTASKS_PER_NODE": "8"}, True) == 1
    # unbound, they share the node's
    assert ranks_sharing_cores({"SLURM_NTASKS_PER_NODE": "8"}, False) == 8
    assert ranks_sharing_cores({"SLURM_NTASKS_PER_NODE": "8(x2)"}, False) == 8
    assert ranks_sharing_cores({}, False) == 1


def test_a_bound_srun_task_uses_its_own_cores(threads_line, monkeypatch):
    """run.sub: srun --ntasks-per-node=8 --cpus-per-task=14 binds each rank to its 14 cores,
    which are its alone."""
    from rnnt.distributed import available_cores

    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    cores = available_cores()
    threads, line = threads_line(None, machine_share=8)
    assert threads == cores and f"({cores} cores / 1 rank(s) on this node" in line
    threads, line = threads_line(None)  # not bound: the node's cores, shared by 8 tasks
    assert threads == max(1, cores // 8) and "/ 8 rank(s) on this node" in line
