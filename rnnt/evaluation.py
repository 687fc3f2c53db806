"""Greedy-decode a dataset and score it: shared by per-epoch evaluation and eval.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rnnt.backends import Choice, backend_line, eval_choices
from rnnt.checkpoint import CheckpointError, open_checkpoint
from rnnt.config import Config
from rnnt.data.augment import BatchTransform
from rnnt.data.pipeline import build_eval_data
from rnnt.data.preflight import PreflightResult
from rnnt.data.tokenizer import Tokenizer
from rnnt.decoding import GreedyDecoder
from rnnt.distributed import DistContext, all_reduce_sum
from rnnt.metrics import word_errors
from rnnt.model import RNNT

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class EvalResult:
    wer: float
    errors: int
    words: int
    utterances: int
    seconds: float
    # of `seconds`, this rank's wait for its loader's batches (worker start, reads, features)
    data_seconds: float = 0.0
    # this rank's hypotheses (utt_id, hypothesis, reference), in loader order
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def utterances_per_second(self) -> float:
        return self.utterances / max(self.seconds, 1e-9)


@torch.no_grad()
def evaluate(
    decoder: GreedyDecoder,
    loader,
    transform: BatchTransform,
    detokenize,
    ctx: DistContext,
) -> EvalResult:
    """Decode every batch of `loader`; WER is summed over all ranks' shards.

    detokenize: token ids -> text (the tokenizer's decode).
    """
    start = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    errors = words = 0
    data_seconds = 0.0
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        data_seconds += time.perf_counter() - asked
        if batch is None:
            break
        batch = transform(batch.to(ctx.device))
        tokens = decoder(batch.feats, batch.feat_lens)
        for utt_id, hyp_ids, ref in zip(batch.utt_ids, tokens, batch.transcripts):
            hyp = detokenize(hyp_ids)
            e, w = word_errors(hyp, ref)
            errors += e
            words += w
            rows.append((utt_id, hyp, ref))
    counts = torch.tensor([errors, words, len(rows)], dtype=torch.float64, device=ctx.device)
    totals = all_reduce_sum(counts, ctx)
    errors, words, count = (int(v) for v in totals.tolist())
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - start
    return EvalResult(errors / max(words, 1), errors, words, count, seconds, data_seconds, rows)


def build_decoder(cfg: Config, model: RNNT) -> GreedyDecoder:
    return GreedyDecoder(
        model,
        blank_idx=model.blank_idx,
        max_symbols_per_step=cfg.eval.max_symbols_per_step,
        max_symbols_per_utterance=cfg.eval.max_symbols_per_utterance,
        mode=cfg.eval.mode,
        batch_size=cfg.eval.batch_size,
        unroll_factor=cfg.eval.cg_unroll_factor,
    )


def detokenizer(tokenizer: Tokenizer | None):
    """Token ids -> text; without a tokenizer (synthetic data) the ids themselves."""
    if tokenizer is not None:
        return tokenizer.decode
    return lambda ids: " ".join(str(i) for i in ids)


@dataclass
class EvalSetup:
    cfg: Config
    model: RNNT
    decoder: GreedyDecoder
    loader: object
    transform: BatchTransform
    tokenizer: Tokenizer | None
    backends: dict[str, Choice]
    inputs: PreflightResult  # what the preflight kept and excluded

    def announce(self, ctx: DistContext) -> None:
        """Print which implementation runs each part (rnnt.backends), on the main rank."""
        if ctx.is_main:
            print(backend_line(self.backends), flush=True)


def load_for_eval(cfg: Config, checkpoint: str, ctx: DistContext, weights: str = "ema"):
    """Build the eval model from `cfg`, load the EMA (or raw) weights of a checkpoint (its
    directory, or its model.pt) into it."""
    choices = eval_choices(cfg, ctx.device)  # a backend that cannot run here stops first
    loader, checked = build_eval_data(cfg, ctx)  # seconds, before the checkpoint's load
    # the workers read the first batches while the checkpoint loads and the model is built
    start_reading = getattr(loader, "read_ahead", None)  # the torch loader's
    if start_reading is not None:
        start_reading()
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    state = open_checkpoint(path).load("model", map_location="cpu")
    dtype = DTYPES[cfg.training.precision] if ctx.device.type == "cuda" else torch.float32
    model = RNNT(cfg.model, cfg.eval.encoder_lstm).to(ctx.device)
    if weights == "ema":
        saved = state["ema"]["weights"]
        params = list(model.parameters())
        if len(saved) != len(params) or any(a.shape != b.shape for a, b in zip(saved, params)):
            raise CheckpointError(f"{path}: its EMA weights do not fit the model of this config")
        with torch.no_grad():
            for p, w in zip(params, saved):
                p.copy_(w)
    else:
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as err:
            first = str(err).splitlines()[0]
            raise CheckpointError(
                f"{path}: weights do not fit the model of this config: {first}"
            ) from None
    model.to(dtype).eval()
    transform = BatchTransform(cfg.features, train=False, dtype=dtype)
    return EvalSetup(
        cfg,
        model,
        build_decoder(cfg, model),
        loader,
        transform,
        checked.tokenizer,
        choices,
        checked,
    )


def score(setup: EvalSetup, ctx: DistContext) -> EvalResult:
    return evaluate(setup.decoder, setup.loader, setup.transform, detokenizer(setup.tokenizer), ctx)
