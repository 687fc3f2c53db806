"""MLPerf Training log (ruleset 3.1.0, benchmark `rnnt`): the only module importing mlperf_logging.

Check a log with
    python -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 LOG

The values logged are the run's real configuration: a config that departs from the closed
division rules (docs/SPEC.md "Logging") produces a log the checker rejects, which is the point
of the check.
"""

from __future__ import annotations

import logging

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

from rnnt.config import Config

# MLLogger's offset 1 is the caller of MLLogger.event; ours sits two frames further out
# (caller -> public method -> _log -> MLLogger.event)
_STACK_OFFSET = 3


class MLPerfLogger:
    """Writes `:::MLLOG` lines to `path` on rank 0; a no-op on other ranks or when path is None.

    Call order of a compliant run: `submission_info`, `cache_clear`, `init_start`,
    `hyperparameters`, `init_stop`, `run_start`, then per epoch `block_start`, `epoch_start`,
    `epoch_stop`, `eval_start`, `eval_accuracy`, `eval_stop`, `block_stop`, and `run_stop`.
    Epoch numbers are 1-based.
    """

    def __init__(self, path: str | None, rank: int) -> None:
        self.enabled = path is not None and rank == 0
        self.path = path
        self._handler: logging.Handler | None = None
        self._ml: MLLogger | None = None
        if self.enabled:
            # a private logging.Logger per file: no stdout echo, several logs per process work
            logger = logging.getLogger(f"rnnt.mlperf.{path}")
            logger.propagate = False
            logger.setLevel(logging.INFO)
            for stale in list(logger.handlers):  # a logger of this file left open earlier
                stale.close()
                logger.removeHandler(stale)
            self._handler = logging.FileHandler(path)
            logger.addHandler(self._handler)
            self._ml = MLLogger(logger=logger, default_stack_offset=_STACK_OFFSET)

    def close(self) -> None:
        if self._handler is not None:
            self._handler.close()
            logging.getLogger(f"rnnt.mlperf.{self.path}").removeHandler(self._handler)
            self._handler = None
            self._ml = None
            self.enabled = False

    def _log(self, kind: str, key: str, value=None, metadata: dict | None = None) -> None:
        if self._ml is None:
            return
        getattr(self._ml, kind)(key=key, value=value, metadata=metadata)

    # ------------------------------------------------------------------------------ metadata
    def submission_info(
        self, org: str, platform: str, division: str = "closed", status: str = "onprem"
    ) -> None:
        """division: closed | open; status: onprem | cloud | preview | research."""
        self._log("event", C.SUBMISSION_BENCHMARK, C.RNNT)
        self._log("event", C.SUBMISSION_ORG, org)
        self._log("event", C.SUBMISSION_DIVISION, division)
        self._log("event", C.SUBMISSION_STATUS, status)
        self._log("event", C.SUBMISSION_PLATFORM, platform)

    def cache_clear(self, cleared: bool) -> None:
        """Whether the launcher dropped the file-system caches before this run."""
        self._log("event", C.CACHE_CLEAR, cleared)

    def hyperparameters(
        self,
        cfg: Config,
        global_batch_size: int,
        train_samples: int,
        eval_samples: int,
        grad_accumulation: int,
    ) -> None:
        """Every hyperparameter key the rnnt rules require, from the run's configuration."""
        opt, feats, spec = cfg.optimizer, cfg.features, cfg.features.spec_augment
        values = [
            (C.SEED, cfg.training.seed),
            (C.GLOBAL_BATCH_SIZE, global_batch_size),
            (C.GRADIENT_ACCUMULATION_STEPS, grad_accumulation),
            (C.TRAIN_SAMPLES, train_samples),
            (C.EVAL_SAMPLES, eval_samples),
            (C.OPT_NAME, "lamb"),
            (C.OPT_BASE_LR, opt.lr),
            (C.OPT_LAMB_EPSILON, opt.eps),
            (C.OPT_WEIGHT_DECAY, opt.weight_decay),
            (C.OPT_GRADIENT_CLIP_NORM, opt.clip_norm),
            (C.OPT_LAMB_BETA_1, opt.beta1),
            (C.OPT_LAMB_BETA_2, opt.beta2),
            (C.OPT_LR_WARMUP_EPOCHS, opt.warmup_epochs),
            (C.OPT_LAMB_LR_HOLD_EPOCHS, opt.hold_epochs),
            # the rules' name for the per-epoch decay factor gamma of the exponential decay
            (C.OPT_LAMB_LR_DECAY_POLY_POWER, opt.lr_decay_gamma),
            (C.OPT_LAMB_LR_MIN, opt.min_lr),
            # linear warmup and exponential decay are the rules' "alternative" functions
            (C.OPT_LR_ALT_DECAY_FUNC, True),
            (C.OPT_LR_ALT_WARMUP_FUNC, True),
            (C.MODEL_EVAL_EMA_FACTOR, opt.ema),
            (C.DATA_TRAIN_MAX_DURATION, cfg.data.max_duration),
            (C.DATA_TRAIN_NUM_BUCKETS, cfg.data.num_buckets),
            (C.DATA_SPEED_PERTURBATON_MIN, feats.speed_perturbation_min),
            (C.DATA_SPEED_PERTURBATON_MAX, feats.speed_perturbation_max),
            (C.DATA_SPEC_AUGMENT_FREQ_N, spec.freq_masks),
            (C.DATA_SPEC_AUGMENT_FREQ_MIN, spec.min_freq),
            (C.DATA_SPEC_AUGMENT_FREQ_MAX, spec.max_freq),
            (C.DATA_SPEC_AUGMENT_TIME_N, spec.time_masks),
            (C.DATA_SPEC_AUGMENT_TIME_MIN, spec.min_time),
            (C.DATA_SPEC_AUGMENT_TIME_MAX, spec.max_time),
            (C.EVAL_MAX_PREDICTION_SYMBOLS, cfg.eval.max_symbols_per_utterance),
        ]
        for key, value in values:
            self._log("event", key, value)

    # ------------------------------------------------------------------------------ phases
    def init_start(self) -> None:
        self._log("start", C.INIT_START)

    def init_stop(self) -> None:
        self._log("end", C.INIT_STOP)

    def run_start(self) -> None:
        self._log("start", C.RUN_START)

    def run_stop(self, status: str) -> None:
        """status: success (target reached) | aborted."""
        if status not in (C.SUCCESS, C.ABORTED):
            raise ValueError(f"run_stop: status must be '{C.SUCCESS}' or '{C.ABORTED}'")
        self._log("end", C.RUN_STOP, metadata={"status": status})

    def block_start(self, first_epoch: int, epoch_count: int = 1) -> None:
        self._log(
            "start",
            C.BLOCK_START,
            metadata={"first_epoch_num": first_epoch, "epoch_count": epoch_count},
        )

    def block_stop(self, first_epoch: int) -> None:
        self._log("end", C.BLOCK_STOP, metadata={"first_epoch_num": first_epoch})

    def epoch_start(self, epoch: int) -> None:
        self._log("start", C.EPOCH_START, metadata={"epoch_num": epoch})

    def epoch_stop(self, epoch: int) -> None:
        self._log("end", C.EPOCH_STOP, metadata={"epoch_num": epoch})

    def eval_start(self, epoch: int) -> None:
        self._log("start", C.EVAL_START, metadata={"epoch_num": epoch})

    def eval_stop(self, epoch: int) -> None:
        self._log("end", C.EVAL_STOP, metadata={"epoch_num": epoch})

    def eval_accuracy(self, wer: float, epoch: int) -> None:
        """The dev-clean word error rate (a fraction, target <= 0.058) after `epoch`."""
        self._log("event", C.EVAL_ACCURACY, float(wer), metadata={"epoch_num": epoch})
