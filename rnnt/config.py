"""Typed run configuration loaded from YAML, with dotted command-line overrides.

Every knob lives in one of the section dataclasses below, and every rule that ties knobs
together lives here too: a section checks its choices (the `Literal` fields) and its own rules
whenever it is built, in code or from a file, and `Config` checks the rules that span sections.
A config that exists is therefore a valid one, and every problem is a `ConfigError` whose one
line names the key and, when loaded, the file. Rules that need the device (fp16 needs CUDA)
are `check_device`'s, called once the device is known.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from rnnt.errors import UserError

LENGTHS_DIR = Path(__file__).resolve().parent / "data" / "lengths"

EncoderLSTM = Literal["cudnn", "wave", "auto"]
DataBackend = Literal["auto", "dali", "torch", "synthetic"]
Place = Literal["cpu", "gpu"]
LossBackend = Literal["reference", "torchaudio", "fused", "apex"]
FusedGemm = Literal["auto", "cublas", "sm90"]
Precision = Literal["fp32", "fp16", "bf16"]
EvalMode = Literal["no_cg", "cg", "cg_unroll_pipeline"]
EvalEncoderLSTM = Literal["cudnn", "wave"]
Preset = Literal["", "gbs512", "gbs1024", "gbs1536", "gbs2048", "gbs4096", "gbs6144"]


class ConfigError(UserError, ValueError):
    """A configuration problem, with a message that names the key and its source."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_choice(value: Any, tp: Any, where: str) -> Any:
    choices = typing.get_args(tp)
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: expected one of {shown}, got {value!r}")
    return value


class _Section:
    """A config section: building one checks its Literal choices, then its own rules."""

    KEY: ClassVar[str] = ""  # its dotted place in Config, for messages

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            tp = _hints(type(self))[f.name]
            if typing.get_origin(tp) is Literal:
                _check_choice(getattr(self, f.name), tp, self.key(f.name))
        self.check()

    def key(self, name: str) -> str:
        return f"{self.KEY}.{name}" if self.KEY else name

    def require(self, ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{self.key(name)}: {message}")

    def at_least(self, minimum: float, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            self.require(value >= minimum, name, f"must be >= {minimum}, got {value}")

    def probability(self, *names: str) -> None:
        for name in names:
            p = getattr(self, name)
            self.require(0 <= p < 1, name, f"a probability needs 0 <= p < 1, got {p}")

    def check(self) -> None:
        """The section's own rules (none by default)."""


@dataclass
class ModelConfig(_Section):
    """The RNN-T of docs/SPEC.md "Model"; the defaults are the MLPerf baseline (49,071,616
    parameters)."""

    KEY: ClassVar[str] = "model"

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
    # The encoder's two LSTM stacks in training: "cudnn" (nn.LSTM + nn.Dropout), "wave" (the
    # Hopper wave kernels of rnnt/kernels/lstm_wave.py, their plain-PyTorch twin off the GPU;
    # hash-based dropout) or "auto" (wave on a Hopper GPU for batches that are multiples of 192,
    # cudnn elsewhere). Same parameters and checkpoints; evaluation always runs nn.LSTM.
    encoder_lstm: EncoderLSTM = "cudnn"

    @property
    def blank_idx(self) -> int:
        return self.n_classes - 1

    def check(self) -> None:
        self.at_least(2, "n_classes")
        self.at_least(1, "in_feats", "enc_n_hid", "pred_n_hid", "joint_n_hid")
        self.at_least(1, "enc_pre_rnn_layers", "enc_post_rnn_layers", "pred_rnn_layers")
        self.at_least(1, "enc_stack_time_factor")
        self.probability("enc_dropout", "pred_dropout", "joint_dropout")
        if self.encoder_lstm == "wave":  # auto falls back to cuDNN where the kernels cannot run
            self.require(
                self.enc_n_hid % 32 == 0,
                "enc_n_hid",
                f"the wave LSTM (model.encoder_lstm: wave) needs a multiple of 32 (its kernels: "
                f"1024), got {self.enc_n_hid}",
            )


@dataclass
class SpecAugmentConfig(_Section):
    KEY: ClassVar[str] = "features.spec_augment"

    freq_masks: int = 2
    min_freq: int = 0
    max_freq: int = 20
    time_masks: int = 10
    min_time: int = 0
    max_time: float = 0.03  # a fraction of each utterance's length (adaptive masks)

    def check(self) -> None:
        self.at_least(0, "freq_masks", "time_masks", "min_freq", "min_time")
        self.require(
            self.min_freq <= self.max_freq,
            "max_freq",
            f"must be >= min_freq {self.min_freq}, got {self.max_freq}",
        )
        self.require(
            0.0 <= self.max_time <= 1.0,
            "max_time",
            f"a fraction of the utterance needs 0 <= max_time <= 1, got {self.max_time}",
        )


@dataclass
class FeaturesConfig(_Section):
    """Audio front end of docs/SPEC.md "Features" (identical for the DALI and torch backends)."""

    KEY: ClassVar[str] = "features"

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

    def check(self) -> None:
        self.at_least(1, "sample_rate", "n_fft", "n_mels", "frame_stack", "frame_subsample")
        stacked = self.frame_stack * self.n_mels
        self.require(
            self.pad_features_to >= stacked,
            "pad_features_to",
            f"must hold frame_stack x n_mels = {stacked} features, got {self.pad_features_to}",
        )
        spec = self.spec_augment
        if spec.freq_masks:
            self.require(
                spec.max_freq <= self.n_mels,
                "spec_augment.max_freq",
                f"a mask cannot be wider than the {self.n_mels} mel bins, got {spec.max_freq}",
            )
        self.require(
            0 < self.speed_perturbation_min <= self.speed_perturbation_max,
            "speed_perturbation_min",
            f"needs 0 < min <= speed_perturbation_max {self.speed_perturbation_max}, got "
            f"{self.speed_perturbation_min}",
        )


@dataclass
class DataConfig(_Section):
    KEY: ClassVar[str] = "data"

    dataset_dir: str = "datasets/LibriSpeech"
    train_manifests: list[str] = field(default_factory=list)
    val_manifests: list[str] = field(default_factory=list)
    tokenizer: str = ""  # SentencePiece model file (model.n_classes - 1 pieces)
    max_duration: float = 16.7  # train utterances longer than this are dropped
    num_buckets: int = 1
    backend: DataBackend = "auto"  # auto: dali where it imports, else torch
    device: Place = "gpu"  # where the feature stage runs
    resampling_device: Place = "cpu"
    num_threads: int = 4
    # batches whose features are computed ahead of the one the trainer takes: the GPU stage
    # of either backend (data.device gpu; 0: computed when taken, the host waiting for it)
    # and DALI's prefetch queue (it holds one more)
    device_prefetch: int = 1
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

    def check(self) -> None:
        self.require(
            self.max_duration > 0, "max_duration", f"must be positive, got {self.max_duration}"
        )
        self.at_least(1, "num_buckets")
        self.at_least(0, "num_threads", "device_prefetch", "synthetic_steps_per_epoch")
        # the resampler runs inside the batched feature stage on the device
        self.require(
            self.resampling_device == "cpu" or self.device == "gpu",
            "resampling_device",
            "gpu needs data.device: gpu",
        )


@dataclass
class LossConfig(_Section):
    KEY: ClassVar[str] = "loss"

    backend: LossBackend = "reference"
    fused_gemm: FusedGemm = "auto"  # the fused backend's logits GEMM

    def check(self) -> None:
        self.require(
            self.fused_gemm == "auto" or self.backend == "fused",
            "fused_gemm",
            f"'{self.fused_gemm}' applies to loss.backend fused only (the backend is "
            f"'{self.backend}')",
        )


@dataclass
class OptimizerConfig(_Section):
    KEY: ClassVar[str] = "optimizer"

    preset: Preset = ""  # a GBS preset of docs/SPEC.md ("gbs1024", ...): fills the fields below
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

    def check(self) -> None:
        self.require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        self.at_least(0, "min_lr", "eps", "weight_decay", "clip_norm")
        self.at_least(0, "warmup_epochs", "hold_epochs")
        self.probability("beta1", "beta2", "ema")


@dataclass
class TrainingConfig(_Section):
    KEY: ClassVar[str] = "training"

    batch_size: int = 192  # per process, per micro-step
    grad_accumulation: int = 1
    epochs: int = 80
    precision: Precision = "fp16"
    init_loss_scale: float = 512.0
    seed: int | None = None  # None: drawn from os.urandom per run (MLPerf), logged and saved
    num_cg: int = 0  # CUDA graphs per network (0 = eager)
    # the dev WER that ends the run (MLPerf: 0.058); 0 turns it off: every epoch runs and is
    # evaluated, and finishing them is the run's success (its MLPerf run_stop says aborted)
    target_wer: float = 0.058
    output_dir: str = "results"
    log_frequency: int = 10
    keep_last_checkpoints: int = 2
    # checkpoints inside the run, written in the background (0: none); the final state is
    # always saved after the run ends
    save_every_epochs: int = 1
    checkpoint_every_steps: int = 0  # also save mid-epoch (0 = only at epoch ends)
    # also score the dev set every N steps inside an epoch (0: at epoch ends only), to see
    # the WER between epochs: these scores stay out of mlperf.log and never end the run, and
    # their time counts in the run's (evaluation draws no random numbers: training is the same)
    eval_every_steps: int = 0
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
    # torch.profiler over steps [profile_from_step, + profile_steps) on every rank, written to
    # OUTPUT_DIR/profile (rnnt/profiling.py); 0: off
    profile_from_step: int = 0
    profile_steps: int = 5
    # record the host's operators too; False: the GPU's work alone, so that the host keeps its
    # unprofiled pace (recording every operator slowed the real-audio step's host enough to
    # change when the GPU got its work). A CPU run records its operators either way.
    profile_host: bool = True

    def check(self) -> None:
        self.at_least(1, "batch_size", "grad_accumulation", "epochs", "log_frequency")
        self.at_least(0, "profile_from_step")
        self.at_least(1, "profile_steps")
        self.at_least(1, "keep_last_checkpoints", "max_consecutive_nonfinite")
        self.at_least(
            0, "num_cg", "save_every_epochs", "checkpoint_every_steps", "eval_every_steps"
        )
        self.at_least(0, "torch_threads", "peak_tflops", "target_wer")
        for name in ("init_loss_scale", "collective_timeout_s"):
            value = getattr(self, name)
            self.require(value > 0, name, f"must be positive, got {value}")


@dataclass
class EvalConfig(_Section):
    KEY: ClassVar[str] = "eval"

    batch_size: int = 338
    mode: EvalMode = "no_cg"
    max_symbols_per_step: int = 30
    max_symbols_per_utterance: int = 300
    cg_unroll_factor: int = 4
    # The encoder's LSTM stacks when scoring: "cudnn" (nn.LSTM) or "wave" (the wave kernels'
    # forward with dropout off, their plain-PyTorch twin off the GPU): the recurrence a
    # model.encoder_lstm wave | auto run trained with, tanh approximations and fp16 included.
    encoder_lstm: EvalEncoderLSTM = "cudnn"

    def check(self) -> None:
        self.at_least(1, "batch_size", "max_symbols_per_step", "max_symbols_per_utterance")
        self.at_least(1, "cg_unroll_factor")


@dataclass
class SystemConfig(_Section):
    """The machine a config is written for (configs/systems/): the run checks that it was
    launched on that many ranks. 0: any."""

    KEY: ClassVar[str] = "system"

    nodes: int = 0
    gpus_per_node: int = 0  # ranks per node (processes on a CPU system)

    def check(self) -> None:
        self.at_least(0, "nodes", "gpus_per_node")


@dataclass
class Config(_Section):
    system: SystemConfig = field(default_factory=SystemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check(self) -> None:
        # the encoder reads the feature stage's padded frames
        self.require(
            self.model.in_feats == self.features.pad_features_to,
            "model.in_feats",
            f"must equal features.pad_features_to {self.features.pad_features_to}, got "
            f"{self.model.in_feats}",
        )
        if self.eval.encoder_lstm == "wave":
            self.require(
                self.model.enc_n_hid % 32 == 0,
                "eval.encoder_lstm",
                f"wave needs model.enc_n_hid to be a multiple of 32 (its kernels: 1024), got "
                f"{self.model.enc_n_hid}",
            )


def check_device(cfg: Config, device_type: str) -> None:
    """The rules that need the device the run is on ("cuda" or "cpu")."""
    if device_type == "cuda":
        return
    rules = [
        (cfg.training.precision != "fp16", "training.precision", "fp16 needs a CUDA device"),
        (cfg.training.num_cg == 0, "training.num_cg", "CUDA graphs need a CUDA device (use 0)"),
        (cfg.loss.backend != "fused", "loss.backend", "fused runs on a CUDA device"),
    ]
    for ok, key, why in rules:
        if not ok:
            raise ConfigError(f"{key}: {why} (this run is on {device_type})")


# --------------------------------------------------------------------------------------------
# Loading


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _check_choice(value, tp, where)
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
    hints = _hints(cls)
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


# docs/SPEC.md "Hyperparameters by global batch size": lr, beta1, beta2, ema, gamma, warmup epochs,
# hold epochs, max epochs, weights_init_scale.
GBS_PRESETS: dict[str, tuple] = {
    "gbs512": (0.0062, 0.9, 0.9985, 0.994, 0.915, 1, 11, 70, 0.45),
    "gbs1024": (0.007447, 0.9, 0.999, 0.992, 0.9037, 3, 17, 80, 0.5),
    "gbs1536": (0.0072, 0.9, 0.999, 0.995, 0.92, 5, 26, 80, 0.5),
    "gbs2048": (0.007, 0.9, 0.999, 0.995, 0.939, 6, 33, 80, 0.5),
    "gbs4096": (0.013, 0.833, 0.98, 0.995, 0.955, 6, 33, 100, 0.5),
    "gbs6144": (0.014, 0.82, 0.98, 0.96, 0.970, 16, 40, 120, 0.5),
}


def preset_values(name: str) -> dict:
    """The config sections a GBS preset fills, as a raw mapping."""
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


def _with_preset(raw: dict) -> dict:
    """Preset values sit under what the file and overrides set explicitly."""
    name = (raw.get("optimizer") or {}).get("preset") or ""
    if not name:
        return raw
    return _merge(preset_values(name), raw)


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
    fills the docs/SPEC.md hyperparameters of that global batch size; values written explicitly in
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
        _check_override(keys, value, text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        raw = _merge(raw, nested)
    if overrides:
        # a rule that ties several keys may be broken by the file or by any override
        source += " with --set " + " --set ".join(overrides)
    return _build_root(_with_preset(raw), source)


def _check_override(keys: list[str], value: Any, text: str) -> None:
    """One override's key exists and its value has the key's type (rules between keys are
    checked on the whole config: one override may need the next)."""
    cls: Any = Config
    for depth, key in enumerate(keys):
        names = {f.name for f in dataclasses.fields(cls)}
        dotted = ".".join(keys[: depth + 1])
        if key not in names:
            raise ConfigError(
                f"override '{text}': unknown key '{dotted}' (valid keys here: "
                f"{', '.join(sorted(names))})"
            )
        tp = _hints(cls)[key]
        if depth == len(keys) - 1:
            try:
                _coerce(value, tp, dotted)
            except ConfigError as err:
                raise ConfigError(f"override '{text}': {err}") from None
        elif not dataclasses.is_dataclass(tp):
            raise ConfigError(f"override '{text}': '{dotted}' is a value, not a section")
        cls = tp


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
