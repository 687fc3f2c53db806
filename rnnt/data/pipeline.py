"""The data of a run, wired from its config: `build_train_data` for the Trainer,
`build_eval_data` for eval.py.

Both start with the preflight (rnnt.data.preflight): manifests, tokenizer and token ids are
checked in seconds, before any model is built, and the ranks agree on what was found. The
synthetic backend (rnnt.data.synthetic) skips it: its utterances come from the lengths tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rnnt.config import Config, ConfigError
from rnnt.data.loader import TrainLoader, build_loader
from rnnt.data.manifest import Utterance
from rnnt.data.preflight import PreflightError, PreflightResult, load_tokenizer, preflight
from rnnt.data.sampler import BucketingSampler
from rnnt.data.synthetic import SyntheticFeatureSource, tokenizer_for_lengths_table
from rnnt.data.tokenizer import Tokenizer
from rnnt.distributed import DistContext, same_on_every_rank


@dataclass
class TrainData:
    """train: this rank's training batches and their position; val: this rank's share of the
    dev set, once per iteration. train_utts: the training set after the length filter (the
    CUDA-graph buckets are sized from it); val_size: dev utterances over all ranks;
    val_longest: seconds of the longest of them (the size its first batch captures at)."""

    train: TrainLoader
    val: object
    tokenizer: Tokenizer | None
    train_utts: Sequence[Utterance]
    val_size: int
    global_batch: int
    val_longest: float


def checked_inputs(cfg: Config, ctx: DistContext, train: bool) -> PreflightResult:
    """The preflight of `cfg`'s manifests and tokenizer, the same on every rank: ranks that
    found different problems would deal different utterances."""
    checked = preflight(cfg.data, cfg.model.n_classes, train=train)
    if not same_on_every_rank(checked.fingerprint(), ctx):
        raise PreflightError(
            "preflight: the ranks found different problems in the same manifests (do they "
            "read the same files? did one change while the run started?)"
        )
    checked.raise_for_problems()
    return checked


def build_eval_loader(cfg: Config, utts: Sequence[Utterance], ctx: DistContext, tokenizer):
    if not utts:
        raise ConfigError(f"data.val_manifests {cfg.data.val_manifests}: no utterances")
    return build_loader(
        cfg,
        utts,
        cfg.data.dataset_dir,
        train=False,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        tokenizer=tokenizer,
    )


def build_eval_data(cfg: Config, ctx: DistContext) -> tuple[object, PreflightResult]:
    """The dev-set loader of eval.py and what the preflight kept and excluded."""
    checked = checked_inputs(cfg, ctx, train=False)
    return build_eval_loader(cfg, checked.val, ctx, checked.tokenizer), checked


def build_train_data(
    cfg: Config, ctx: DistContext, out_dir: Path, info: Callable[[str], None]
) -> TrainData:
    """The training and dev batches of this rank; `info` receives the lines a user reads
    (what the preflight excluded, the set sizes, the steps per epoch)."""
    dcfg, tcfg = cfg.data, cfg.training
    global_batch = tcfg.batch_size * tcfg.grad_accumulation * ctx.world_size
    if dcfg.backend == "synthetic":
        return _synthetic(cfg, ctx, out_dir, info, global_batch)
    checked = checked_inputs(cfg, ctx, train=True)
    info(checked.summary())
    for problem in checked.problems:
        info(f"excluded: {problem}")
    kept = [u for u in checked.train if u.duration <= dcfg.max_duration]
    if not kept:
        raise ConfigError(f"data.train_manifests {dcfg.train_manifests}: no utterances")
    if len(kept) < global_batch:
        raise ConfigError(
            f"{len(kept)} training utterances cannot fill one global batch of {global_batch} "
            "(training.batch_size x grad_accumulation x world size)"
        )
    sampler = BucketingSampler(
        [u.duration for u in kept],
        global_batch_size=global_batch,
        num_buckets=dcfg.num_buckets,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=tcfg.seed,
    )
    train = build_loader(
        cfg,
        kept,
        dcfg.dataset_dir,
        train=True,
        sampler=sampler,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        tokenizer=checked.tokenizer,
    )
    val = build_eval_loader(cfg, checked.val, ctx, checked.tokenizer)
    info(
        f"data: {len(kept)} train utterances ({len(checked.train) - len(kept)} dropped longer "
        f"than {dcfg.max_duration} s), {len(checked.val)} dev utterances, global batch "
        f"{global_batch}, {len(train)} steps per epoch"
    )
    longest = max(u.duration for u in checked.val)
    return TrainData(train, val, checked.tokenizer, kept, len(checked.val), global_batch, longest)


def _synthetic(
    cfg: Config, ctx: DistContext, out_dir: Path, info: Callable[[str], None], global_batch: int
) -> TrainData:
    """Noise features at real LibriSpeech lengths, for speed runs and GPU checks without
    audio; WER on them is meaningless."""
    dcfg = cfg.data
    tokenizer = load_tokenizer(dcfg.tokenizer, cfg.model.n_classes)
    if tokenizer is None:
        tokenizer = tokenizer_for_lengths_table(
            dcfg.synthetic_train_lengths, cfg.model.n_classes - 1, out_dir / "tokenizer"
        )
    common = dict(
        tokenizer=tokenizer,
        features=cfg.features,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=cfg.training.seed,
        device=ctx.device,
    )
    source = SyntheticFeatureSource(
        dcfg.synthetic_train_lengths,
        cfg.training.batch_size * cfg.training.grad_accumulation,
        train=True,
        max_duration=dcfg.max_duration,
        num_batches=dcfg.synthetic_steps_per_epoch or None,
        **common,
    )
    val = SyntheticFeatureSource(
        dcfg.synthetic_val_lengths, cfg.eval.batch_size, train=False, **common
    )
    train_utts = [
        Utterance(i, "", float(d), t, tok)
        for i, d, t, tok in zip(source.utt_ids, source.durations, source.transcripts, source.tokens)
    ]
    info(
        f"data: SYNTHETIC noise features at the lengths of {dcfg.synthetic_train_lengths} "
        f"({len(train_utts)} train) and {dcfg.synthetic_val_lengths} "
        f"({len(val.utt_ids)} dev); {len(source)} steps per epoch"
    )
    train = TrainLoader(source, source.plan)
    longest = float(max(val.durations))
    return TrainData(train, val, tokenizer, train_utts, len(val.utt_ids), global_batch, longest)
