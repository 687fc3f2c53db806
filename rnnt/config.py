"""Typed run configuration loaded from YAML, with dotted command-line overrides.

Every knob lives in one of the section dataclasses below. A YAML file names a subset of them;
unknown or misspelled keys and values of the wrong type are rejected with a message that names
the key and the file, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rnnt.errors import UserError

LENGTHS_DIR = Path(__file__).resolve().parent / "data" / "lengths"


class ConfigError(UserError, ValueError):
    """A configuration problem, with a message that names the key and its source."""


@dataclass
class ModelConfig:
    """The RNN-T of SPEC.md; the defaults are the MLPerf baseline (49,071,616 parameters)."""

    n_classes: int = 1024  # vocabulary pieces + blank; blank is the last index
    in_feats: int = 256  # 80 mels x stack 3 = 240, padded to a multiple of 32
    enc_n_hid: int = 1024
    enc_pre_rnn_layers: int = 2
    enc_post_rnn_layers: int = 3
    enc_stack_time_factor: int = 2
    enc_dropout: float = 0.1
    pred_n_hid: int = 512
    pred_rnn_layers: int = 2
    pred_dropout: float = 0.3
    joint_n_hid: int = 512
    joint_dropout: float = 0.3
    forget_gate_bias: float = 1.0
    hidden_hidden_bias_scale: float = 0.0
    weights_init_scale: float = 0.5
    # One nn.LSTM per layer instead of one multi-layer cuDNN LSTM: same maths, same
    # parameter count, but each layer is its own module (separately capturable/fusable).
    decoupled_rnns: bool = False
    # The encoder's two LSTM stacks in training: "cudnn" (nn.LSTM + nn.Dropout), "wave" (the
    # Hopper wave kernels of rnnt/kernels/lstm_wave.py, their plain-PyTorch twin off the GPU;
    # hash-based dropout) or "auto" (wave on a Hopper GPU for batches that are multiples of 192,
    # cudnn elsewhere). Same parameters and checkpoints; evaluation always runs nn.LSTM.
    encoder_lstm: str = "cudnn"

    @property
    def blank_idx(self) -> int:
        return self.n_classes - 1


@dataclass
class SpecAugmentConfig:
    freq_masks: int = 2
    min_freq: int = 0
    max_freq: int = 20
    time_masks: int = 10
    min_time: int = 0
    max_time: float = 0.03  # a fraction of each utterance's length (adaptive masks)


@dataclass
class FeaturesConfig:
    """Audio front end of SPEC.md (identical for the DALI and torch backends)."""

    sample_rate: int = 16000
    n_fft: int = 512
    window_size: float = 0.02  # seconds -> 320 samples
    window_stride: float = 0.01  # seconds -> 160 samples
    n_mels: int = 80
    dither: float = 1e-5
    preemph: float = 0.97
    log_floor: float = 1e-20
    silence_threshold_db: float = -60.0
    frame_stack: int = 3
    frame_subsample: int = 3
    pad_features_to: int = 256
    speed_perturbation_min: float = 0.85
    speed_perturbation_max: float = 1.15
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)


@dataclass
class DataConfig:
    dataset_dir: str = "datasets/LibriSpeech"
    train_manifests: list[str] = field(default_factory=list)
    val_manifests: list[str] = field(default_factory=list)
    tokenizer: str = ""  # SentencePiece model file
    vocab_size: int = 1023
    max_duration: float = 16.7  # train utterances longer than this are dropped
    num_buckets: int = 1
    backend: str = "auto"  # auto | dali | torch | synthetic
    device: str = "gpu"  # feature stage: cpu | gpu
    resampling_device: str = "cpu"  # cpu | gpu
    num_threads: int = 4
    # exclude and count the utterances the preflight finds bad (manifest line, audio path,
    # tokens) and drop those that cannot be read in training, instead of stopping the run
    skip_bad: bool = False
    # synthetic backend: utterance lengths sampled from real LibriSpeech length tables (the
    # defaults ship in rnnt/data/lengths)
    synthetic_train_lengths: str = str(LENGTHS_DIR / "librispeech_train-clean-5_lengths.tsv")
    synthetic_val_lengths: str = str(LENGTHS_DIR / "librispeech_dev-clean_lengths.tsv")
    # batches per epoch of the synthetic backend (0: one pass over the lengths table); the
    # shipped training table fills only 7 batches of 192
    synthetic_steps_per_epoch: int = 0


@dataclass
class LossConfig:
    backend: str = "reference"  # reference | torchaudio | fused | apex
    fused_gemm: str = "auto"  # auto | cublas | sm90: the fused backend's logits GEMM


@dataclass
class OptimizerConfig:
    preset: str = ""  # a GBS preset of SPEC.md ("gbs1024", ...): fills the fields below
    lr: float = 0.007447
    min_lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-9
    weight_decay: float = 1e-3
    clip_norm: float = 1.0
    ema: float = 0.992
    warmup_epochs: int = 3
    hold_epochs: int = 17
    lr_decay_gamma: float = 0.9037
    # a preset's hyperparameters belong to its global batch size; a run at another one is
    # refused unless this says it is meant (speed runs, smoke tests on fewer GPUs)
    allow_gbs_mismatch: bool = False


@dataclass
class TrainingConfig:
    batch_size: int = 192  # per process, per micro-step
    grad_accumulation: int = 1
    epochs: int = 80
    precision: str = "fp16"  # fp32 | fp16 | bf16
    init_loss_scale: float = 512.0
    seed: int | None = None  # None: drawn from os.urandom per run (MLPerf), logged and saved
    num_cg: int = 0  # CUDA graphs per network (0 = eager)
    target_wer: float = 0.058
    output_dir: str = "results"
    log_frequency: int = 10
    keep_last_checkpoints: int = 2
    # checkpoints inside the run, written in the background (0: none); the final state is
    # always saved after the run ends
    save_every_epochs: int = 1
    checkpoint_every_steps: int = 0  # also save mid-epoch (0 = only at epoch ends)
    max_consecutive_nonfinite: int = 100
    # torch's intra-op threads per rank (0: the rank's share of its cores less data.num_threads)
    torch_threads: int = 0
    # seconds any collective (and a checkpoint's commit) may wait for the other ranks: past
    # it a dead or stuck rank ends the job instead of hanging it
    collective_timeout_s: float = 600.0
    # reduce-scatter each gradient bucket as soon as the backward has finished it (False:
    # all buckets after the backward, for measuring what the overlap hides)
    overlap_grad_reduce: bool = True
    # the dense fp16 matrix peak that the logged MFU is relative to; 0: the datasheet value of
    # a known GPU (rnnt/flops.py), none on the CPU
    peak_tflops: float = 0.0
    deterministic: bool = False


@dataclass
class EvalConfig:
    batch_size: int = 338
    mode: str = "no_cg"  # no_cg | cg | cg_unroll_pipeline
    max_symbols_per_step: int = 30
    max_symbols_per_utterance: int = 300
    cg_unroll_factor: int = 4
    use_ema: bool = True


@dataclass
class SystemConfig:
    """The machine a config is written for (configs/systems/): the run checks that it was
    launched on that many ranks. 0: any."""

    nodes: int = 0
    gpus_per_node: int = 0  # ranks per node (processes on a CPU system)


@dataclass
class Config:
    system: SystemConfig = field(default_factory=SystemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------------------------
# Loading


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)[:1]
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any float literal
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")


def _build(cls: type, raw: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown key '{key}' (valid keys here: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in raw.items()}
    return cls(**kwargs)


def _build_root(raw: dict, source: str) -> Config:
    try:
        return _build(Config, raw, "")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse one `section.key=value` override; the value is read as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected the form section.key=value")
    dotted, value_text = text.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{text}': empty key in '{dotted}'")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': value is not valid YAML ({err})") from None
    return keys, value


# Hyperparameters by global batch size (SPEC.md): lr, beta1, beta2, ema, gamma, warmup epochs,
# hold epochs, max epochs, weights_init_scale.
GBS_PRESETS: dict[str, tuple] = {
    "gbs512": (0.0062, 0.9, 0.9985, 0.994, 0.915, 1, 11, 70, 0.45),
    "gbs1024": (0.007447, 0.9, 0.999, 0.992, 0.9037, 3, 17, 80, 0.5),
    "gbs1536": (0.0072, 0.9, 0.999, 0.995, 0.92, 5, 26, 80, 0.5),
    "gbs2048": (0.007, 0.9, 0.999, 0.995, 0.939, 6, 33, 80, 0.5),
    "gbs4096": (0.013, 0.833, 0.98, 0.995, 0.955, 6, 33, 100, 0.5),
    "gbs6144": (0.014, 0.82, 0.98, 0.96, 0.970, 16, 40, 120, 0.5),
}


def preset_values(name: str, where: str) -> dict:
    """The config sections a GBS preset fills, as a raw mapping."""
    if name not in GBS_PRESETS:
        raise ConfigError(
            f"{where}: unknown optimizer preset '{name}' (one of {', '.join(GBS_PRESETS)})"
        )
    lr, b1, b2, ema, gamma, warmup, hold, epochs, init = GBS_PRESETS[name]
    return {
        "optimizer": {
            "lr": lr,
            "beta1": b1,
            "beta2": b2,
            "ema": ema,
            "lr_decay_gamma": gamma,
            "warmup_epochs": warmup,
            "hold_epochs": hold,
        },
        "training": {"epochs": epochs},
        "model": {"weights_init_scale": init},
    }


def _with_preset(raw: dict, where: str) -> dict:
    """Preset values sit under what the file and overrides set explicitly."""
    name = (raw.get("optimizer") or {}).get("preset") or ""
    if not name:
        return raw
    return _merge(preset_values(name, where), raw)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw


def _read_with_base(path: Path, seen: tuple[Path, ...]) -> dict:
    """A config file over the file its `base:` key names (relative to it), recursively."""
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a file name, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: base: {base} includes itself")
    under = _read_with_base(base_path, (*seen, path.resolve()))
    try:
        _build_root(under, str(base_path))
    except ConfigError as err:
        raise ConfigError(f"{err} (the base of {path})") from None
    return _merge(under, raw)


def preset_global_batch(name: str) -> int:
    """The global batch size a GBS preset is for ("gbs1536" -> 1536)."""
    return int(name.removeprefix("gbs"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load `path` (YAML), apply `section.key=value` overrides, return a validated Config.

    A file may name another as its `base:` (relative to it) and set only what differs, as the
    system overlays of configs/systems/ do. A named GBS preset (`optimizer.preset: gbs1024`)
    fills the SPEC.md hyperparameters of that global batch size; values written explicitly in
    the file or on the command line win.
    """
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw = _read_with_base(Path(path), seen=())
    _build_root(raw, source)  # validate the file alone first, so its errors name it
    for text in overrides or []:
        keys, value = parse_override(text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        raw = _merge(raw, nested)
        _build_root(raw, f"override '{text}'")
    return _build_root(_with_preset(raw, source), source)


def load_config_or_exit(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """load_config for command-line entry points: a config problem prints its one-line message
    to stderr and exits with status 2 (no traceback for a typo)."""
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def add_config_args(parser) -> None:
    """Add the shared `config` / `--set` arguments to an argparse parser."""
    parser.add_argument("config", help="YAML config file (see configs/)")
    add_override_arg(parser)


def add_override_arg(parser) -> None:
    """Add the repeatable `--set SECTION.KEY=VALUE` argument (dest: overrides)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set model.enc_n_hid=320 (repeatable)",
    )
