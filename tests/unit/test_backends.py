"""Each automatic choice comes from one resolver, returns (choice, reason), and the run's line
shows the choices (rnnt.backends)."""

import re

import pytest
import torch

from rnnt.backends import backend_line, data_choice, eval_choices, training_choices
from rnnt.config import ConfigError, ModelConfig, load_config
from rnnt.loss import TransducerLoss
from rnnt.model import RNNT, Joint, resolve_encoder_lstm
from rnnt.optim.lamb import resolve_update

CPU = torch.device("cpu")


def test_the_training_line_on_the_cpu_names_every_choice():
    cfg = load_config(None, ["data.backend=torch", "data.device=cpu", "training.precision=fp32"])
    joint = Joint(cfg.model)
    loss = TransducerLoss(cfg.loss.backend, cfg.model.blank_idx).prepare(joint)
    choices = training_choices(cfg, CPU, loss, resolve_update(CPU))
    line = backend_line(choices)
    assert line == (
        "backends: data=torch/cpu encoder_lstm=cudnn loss=reference lamb=torch "
        "eval_encoder_lstm=cudnn"
    )
    assert choices["lamb"] == ("torch", "the Triton kernel runs on CUDA, not on cpu")
    assert choices["encoder_lstm"] == ("cudnn", "model.encoder_lstm: cudnn")
    assert choices["data"][1] == "data.backend: torch; features on data.device: cpu"


def test_the_data_choice_names_the_feature_stage_unless_synthetic():
    assert data_choice(load_config(None, ["data.backend=torch"])) == (
        "torch/gpu",
        "data.backend: torch; features on data.device: gpu (resampling, silence trim and "
        "framing in Triton kernels)",
    )
    assert data_choice(load_config(None, ["data.backend=synthetic"]))[0] == "synthetic"
    assert eval_choices(load_config(None, ["data.backend=torch", "data.device=cpu"]), CPU) == {
        "data": ("torch/cpu", "data.backend: torch; features on data.device: cpu"),
        "encoder_lstm": ("cudnn", "eval.encoder_lstm: cudnn"),
    }


def test_the_eval_encoder_choice_off_the_gpu_is_the_kernels_twin():
    cfg = load_config(None, ["data.backend=torch", "data.device=cpu", "eval.encoder_lstm=wave"])
    assert eval_choices(cfg, CPU)["encoder_lstm"] == (
        "wave",
        "the kernels' plain-PyTorch twin on cpu (slow, for tests)",
    )


def test_the_encoder_lstm_choice_off_the_gpu():
    cfg = ModelConfig(encoder_lstm="auto")
    assert resolve_encoder_lstm(cfg, CPU, 192) == (
        "cudnn",
        "auto: the wave kernels run on a Hopper GPU, not on cpu",
    )
    choice, reason = resolve_encoder_lstm(ModelConfig(encoder_lstm="wave"), CPU, 8)
    assert choice == "wave" and "twin" in reason


def test_the_model_trains_with_the_lstm_its_resolver_names(monkeypatch):
    # the line and the forward pass ask the same resolver: an auto stack on the CPU runs nn.LSTM
    from rnnt.kernels import lstm_wave

    def never(*args, **kwargs):
        raise AssertionError("auto ran the wave kernels on the CPU")

    monkeypatch.setattr(lstm_wave, "lstm_stack", never)
    sizes = dict(n_classes=6, in_feats=8, enc_n_hid=32, pred_n_hid=8, joint_n_hid=8)
    cfg = ModelConfig(encoder_lstm="auto", **sizes)
    model = RNNT(cfg).train()
    f, _ = model.encode(torch.randn(4, 2, 8), torch.tensor([4, 3]))
    assert f.shape == (2, 2, 8)


def test_the_fused_loss_reports_its_gemm_and_walk():
    pytest.importorskip("triton")
    joint = Joint(ModelConfig(joint_n_hid=16, n_classes=12))
    choice, reason = TransducerLoss("fused", 11).prepare(joint)
    if torch.cuda.is_available():
        pytest.skip("the CPU's answer; the GPU's is test_gpu_... below")
    assert choice == "fused(gemm=torch, walk=triton)"
    assert "interpreter" in reason


@pytest.mark.gpu
def test_gpu_the_fused_loss_reports_its_gemm_and_walk():
    joint = Joint(ModelConfig()).cuda().half()
    choice, reason = TransducerLoss("fused", 1023).prepare(joint)
    assert re.fullmatch(r"fused\(gemm=(sm90|cublas), walk=(cuda|triton)\)", choice), choice
    assert reason.startswith("gemm: ") and "; walk: " in reason
    if torch.cuda.get_device_capability() != (9, 0):
        assert "gemm=cublas" in choice and "Hopper" in reason
    with pytest.raises(ConfigError, match="loss.fused_gemm: .*sm90 logits GEMM cannot run"):
        TransducerLoss("fused", 1023, "sm90").prepare(joint.float())
