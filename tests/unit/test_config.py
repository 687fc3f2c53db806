import ast
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from rnnt import config as config_module
from rnnt.config import (
    GBS_PRESETS,
    Config,
    ConfigError,
    DataConfig,
    FeaturesConfig,
    LossConfig,
    ModelConfig,
    Preset,
    SpecAugmentConfig,
    check_device,
    load_config,
)


def test_baseline_config_matches_spec(repo_root):
    cfg = load_config(repo_root / "configs/baseline_v3-1023sp.yaml")
    assert cfg.model.n_classes == 1024 and cfg.model.blank_idx == 1023
    assert cfg.features.n_mels == 80 and cfg.features.pad_features_to == 256
    assert cfg.features.spec_augment.max_time == 0.03
    assert cfg.data.max_duration == 16.7
    # gbs1536 preset: 8 GPUs x 192
    assert (cfg.optimizer.lr, cfg.optimizer.ema, cfg.optimizer.warmup_epochs) == (0.0072, 0.995, 5)
    assert cfg.training.epochs == 80 and cfg.model.weights_init_scale == 0.5


def test_dotted_overrides_and_types():
    cfg = load_config(None, ["model.enc_n_hid=320", "optimizer.lr=1e-3", "eval.mode=cg"])
    assert cfg.model.enc_n_hid == 320
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.eval.mode == "cg"
    cfg = load_config(None, ["optimizer.lr=2"])  # an int where a float is expected is fine
    assert isinstance(cfg.optimizer.lr, float)


def test_preset_fills_and_explicit_values_win():
    cfg = load_config(None, ["optimizer.preset=gbs512", "optimizer.beta2=0.5"])
    lr, b1, _, ema, gamma, warmup, hold, epochs, init = GBS_PRESETS["gbs512"]
    assert cfg.optimizer.lr == lr and cfg.optimizer.beta1 == b1 and cfg.optimizer.ema == ema
    assert cfg.optimizer.beta2 == 0.5
    assert (cfg.optimizer.lr_decay_gamma, cfg.optimizer.warmup_epochs) == (gamma, warmup)
    assert cfg.optimizer.hold_epochs == hold and cfg.training.epochs == epochs
    assert cfg.model.weights_init_scale == init


@pytest.mark.parametrize(
    "text, message",
    [
        ("model:\n  enc_nhid: 3\n", "unknown key 'model.enc_nhid'"),
        ("modle:\n  enc_n_hid: 3\n", "unknown key 'modle'"),
        ("model:\n  enc_n_hid: big\n", "model.enc_n_hid: expected an integer, got 'big'"),
        ("training:\n  deterministic: 1\n", "training.deterministic: expected true or false"),
        ("optimizer:\n  preset: gbs999\n", "optimizer.preset: expected one of '', 'gbs512'"),
        ("data:\n  backend: dalii\n", "data.backend: expected one of 'auto', 'dali'"),
        ("data:\n  device: tpu\n", "data.device: expected one of 'cpu', 'gpu', got 'tpu'"),
        ("features:\n  n_mels: 100\n", "features.pad_features_to: must hold frame_stack x"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("model: [\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key_and_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value).strip()


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="override 'model.enc_n_hid': expected the form"):
        load_config(None, ["model.enc_n_hid"])
    with pytest.raises(ConfigError, match="override 'eval.batch_size=x'.*expected an integer"):
        load_config(None, ["eval.batch_size=x"])


def test_cli_reports_one_line_error(tmp_path, repo_root):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  epochz: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rnnt.model", str(path)],
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "unknown key 'training.epochz'" in proc.stderr


CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_config_loads_and_every_system_overlay_fits_its_machine(path):
    from rnnt.trainer import check_system

    cfg = load_config(path)
    if path.parent.name == "systems":
        ranks = cfg.system.nodes * cfg.system.gpus_per_node
        assert ranks > 0, f"{path.name} names no machine"
        check_system(cfg, ranks, cfg.training.batch_size * cfg.training.grad_accumulation * ranks)


def test_the_convergence_runs_keep_the_checkpoints_that_forks_start_from(repo_root):
    for name in ("sentences.yaml", "sentences_plain.yaml"):
        cfg = load_config(repo_root / "configs/convergence" / name)
        assert cfg.training.save_every_epochs == 1, name
        assert cfg.training.keep_last_checkpoints >= 2, name


def test_the_run_must_match_its_system_and_its_preset(repo_root):
    from rnnt.trainer import check_system

    cfg = load_config(repo_root / "configs/systems/dgxh100_1x8x192.yaml")
    assert cfg.model.n_classes == 1024 and cfg.optimizer.lr == 0.0072  # the base and its preset
    with pytest.raises(ConfigError, match=r"1 node\(s\) x 8 GPUs = 8 ranks, but this run has 4"):
        check_system(cfg, 4, 768)
    cfg = load_config(repo_root / "configs/baseline_v3-1023sp.yaml")
    with pytest.raises(ConfigError, match=r"gbs1536 .* of 1536, but this run's is 768 .* 4 ranks"):
        check_system(cfg, 4, 768)
    cfg.optimizer.allow_gbs_mismatch = True
    check_system(cfg, 4, 768)


def test_a_base_is_read_relative_to_its_file_and_cannot_loop(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text("training:\n  batch_size: 7\n  epochs: 3\n")
    (tmp_path / "sub" / "over.yaml").write_text("base: ../base.yaml\ntraining:\n  epochs: 5\n")
    cfg = load_config(tmp_path / "sub" / "over.yaml")
    assert (cfg.training.batch_size, cfg.training.epochs) == (7, 5)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("traning:\n  epochs: 1\n")
    (tmp_path / "uses_bad.yaml").write_text("base: bad.yaml\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'traning'.*the base of"):
        load_config(tmp_path / "uses_bad.yaml")


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: DataConfig(device="cpu", resampling_device="gpu"),
            "data.resampling_device: gpu needs data.device: gpu",
        ),
        (
            lambda: FeaturesConfig(spec_augment=SpecAugmentConfig(max_freq=90)),
            "features.spec_augment.max_freq: a mask cannot be wider than the 80 mel bins, got 90",
        ),
        (
            lambda: FeaturesConfig(pad_features_to=200),
            "features.pad_features_to: must hold frame_stack x n_mels = 240 features, got 200",
        ),
        (
            lambda: SpecAugmentConfig(min_freq=5, max_freq=2),
            "features.spec_augment.max_freq: must be >= min_freq 5, got 2",
        ),
        (
            lambda: ModelConfig(encoder_lstm="wave", enc_n_hid=100),
            "model.enc_n_hid: the wave LSTM (model.encoder_lstm: wave) needs a multiple of 32",
        ),
        (
            lambda: ModelConfig(joint_dropout=1.0),
            "model.joint_dropout: a probability needs 0 <= p < 1, got 1.0",
        ),
        (lambda: ModelConfig(n_classes=1), "model.n_classes: must be >= 2, got 1"),
        (lambda: DataConfig(device_prefetch=-1), "data.device_prefetch: must be >= 0, got -1"),
        (
            lambda: LossConfig(backend="reference", fused_gemm="sm90"),
            "loss.fused_gemm: 'sm90' applies to loss.backend fused only",
        ),
        (
            lambda: Config(model=ModelConfig(in_feats=240)),
            "model.in_feats: must equal features.pad_features_to 256, got 240",
        ),
    ],
)
def test_rules_between_keys_hold_wherever_a_config_is_built(build, message):
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value).startswith(message)


def test_a_rule_broken_by_the_file_and_its_overrides_names_both(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  device: gpu\n  resampling_device: gpu\n")
    # one override may need the next: only the whole is checked against the rules
    cfg = load_config(path, ["data.device=cpu", "data.resampling_device=cpu"])
    assert (cfg.data.device, cfg.data.resampling_device) == ("cpu", "cpu")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["data.device=cpu"])
    message = str(err.value)
    assert message.startswith(f"{path} with --set data.device=cpu: data.resampling_device: gpu")
    with pytest.raises(ConfigError, match="override 'data.device=tpu': data.device: expected"):
        load_config(path, ["data.device=tpu"])
    with pytest.raises(ConfigError, match="override 'data.nope=1': unknown key 'data.nope'"):
        load_config(path, ["data.nope=1"])


def test_rules_that_need_the_device_are_checked_once_it_is_known():
    cfg = load_config(None, ["training.precision=fp16", "loss.backend=fused"])
    check_device(cfg, "cuda")
    with pytest.raises(ConfigError, match="training.precision: fp16 needs a CUDA device"):
        check_device(cfg, "cpu")
    cfg.training.precision = "fp32"
    with pytest.raises(ConfigError, match="loss.backend: fused runs on a CUDA device"):
        check_device(cfg, "cpu")


def test_the_preset_choices_are_the_presets():
    assert typing.get_args(Preset) == ("", *GBS_PRESETS)


def _sections(cls=Config):
    yield cls
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _sections(tp)


def test_every_config_field_is_read_outside_the_config_module():
    """A knob nothing reads is a dead option: some module of the package (not rnnt/config.py)
    must read each field as an attribute."""
    package = Path(config_module.__file__).parent
    read = set()
    for path in package.rglob("*.py"):
        if path == Path(config_module.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
    unread = [
        f"{cls.KEY}.{f.name}" if cls.KEY else f.name
        for cls in _sections()
        for f in dataclasses.fields(cls)
        if f.name not in read
    ]
    assert not unread
