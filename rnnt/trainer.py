"""The training loop: data, model, LAMB, precision, EMA, evaluation, checkpoints, MLPerf log.

`Trainer(cfg, ctx).fit()` trains until the dev WER reaches `training.target_wer` or the epochs
run out. The step is sync-free: losses stay on the device and are read only at logging points,
skipped (non-finite) steps are counted on the device and checked at the same points. The log
points are the loop's only host syncs; each closes a throughput window (rnnt.throughput).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rnnt.backends import backend_line, training_choices
from rnnt.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    open_checkpoint,
    restore_rng_state,
)
from rnnt.config import Config, ConfigError, check_device, preset_global_batch, to_dict
from rnnt.data.augment import BatchTransform, spliced_length
from rnnt.data.batch import FeatureBatch
from rnnt.data.features import num_frames, window_samples
from rnnt.data.pipeline import build_train_data
from rnnt.data.sampler import SamplerStateError
from rnnt.distributed import (
    DistContext,
    agree_on_run_id,
    agree_on_seed,
    all_reduce_sum,
    any_rank,
    barrier,
    set_torch_threads,
)
from rnnt.evaluation import DTYPES, EvalResult, build_decoder, detokenizer, evaluate
from rnnt.flops import peak_flops, step_flops
from rnnt.host_lengths import to_device
from rnnt.loss import TransducerLoss
from rnnt.mlperf import MLPerfLogger
from rnnt.model import RNNT, gradient_buckets
from rnnt.optim.distributed_lamb import DistributedLamb
from rnnt.optim.ema import EMA
from rnnt.optim.loss_scaler import DynamicLossScaler
from rnnt.optim.schedule import lr_at
from rnnt.preemption import Preempted, PreemptionFlag
from rnnt.profiling import StepProfiler
from rnnt.run_log import RunLog
from rnnt.seeds import rank_seeds
from rnnt.throughput import ClosedWindow, StepParts, ThroughputWindow


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class _LogPoint:
    """A training log point whose numbers are still on their way from the device."""

    step: int
    epoch: int
    lr: float
    values: torch.Tensor  # host: loss, loss scale, skipped steps, skipped in a row[, flags]
    window: ClosedWindow
    local_flags: list[float] | None  # this rank's flags where no other rank's exist


@dataclass
class Progress:
    epoch: int = 1  # 1-based, as in the MLPerf log
    step: int = 0  # optimizer steps taken (including skipped ones)
    best_wer: float = math.inf


class Trainer:
    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        mlperf: MLPerfLogger | None = None,
        resume: bool = False,
    ):
        """resume: continue the run of output_dir (`resume()` loads its newest checkpoint);
        its run id is the saved one, and so is its seed unless the config names one."""
        self.cfg = cfg
        self.ctx = ctx
        tcfg = cfg.training
        check_device(cfg, ctx.device.type)
        self.dtype = DTYPES[tcfg.precision]
        self.out_dir = Path(tcfg.output_dir)
        self.mlperf = mlperf or MLPerfLogger(None, ctx.rank)
        self.log = RunLog(self.out_dir, is_main=ctx.is_main)
        self.progress = Progress()
        self.checkpoints = CheckpointManager(
            self.out_dir / "checkpoints",
            keep_last=tcfg.keep_last_checkpoints,
            rank=ctx.rank,
            world_size=ctx.world_size,
            commit_timeout_s=tcfg.collective_timeout_s,
        )
        newest = self.checkpoints.complete() if resume else []
        saved = newest[0].meta if newest else {}
        if tcfg.seed is not None:
            seed_source = "training.seed"
        elif saved.get("seed") is not None:
            seed_source = "the checkpoint"
        else:
            seed_source = "drawn"
        tcfg.seed = agree_on_seed(tcfg.seed if tcfg.seed is not None else saved.get("seed"), ctx)
        # one id per run: its checkpoints carry it, and retention deletes only its own
        self.run_id = agree_on_run_id(saved.get("run_id"), ctx)
        self.checkpoints.run_id = self.run_id
        self.log.run(self.run_id, tcfg.seed, seed_source, ctx.world_size, resumed=bool(newest))
        self.log.info(set_torch_threads(cfg.data.num_threads, tcfg.torch_threads))
        self.seeds = rank_seeds(tcfg.seed, ctx.rank)
        torch.manual_seed(self.seeds.torch)
        # set by train.py; the loop checks it at its log points
        self.preemption: PreemptionFlag | None = None
        if tcfg.deterministic:
            torch.use_deterministic_algorithms(True)

        self.profiler = StepProfiler(
            tcfg.profile_from_step,
            tcfg.profile_steps,
            self.out_dir,
            ctx.rank,
            ctx.device,
            host=tcfg.profile_host,
        )
        self._build_data()
        self._build_model()

    # ---------------------------------------------------------------------------- building
    def _build_data(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.global_batch = (
            cfg.training.batch_size * cfg.training.grad_accumulation * ctx.world_size
        )
        check_system(cfg, ctx.world_size, self.global_batch)
        self.data = build_train_data(cfg, ctx, self.out_dir, self.log.info)
        self.train_loader = self.data.train
        self.tokenizer = self.data.tokenizer

    def _build_model(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        ocfg = cfg.optimizer
        self.model = RNNT(cfg.model).to(ctx.device)
        self._broadcast_parameters()  # no DDP wrapper: every rank starts from rank 0's weights
        # Built on the fp32 initial weights, so the fp32 masters are exact, then cast.
        self.optimizer = DistributedLamb(
            gradient_buckets(self.model),
            ctx,
            betas=(ocfg.beta1, ocfg.beta2),
            eps=ocfg.eps,
            weight_decay=ocfg.weight_decay,
            max_grad_norm=ocfg.clip_norm,
            overlap=cfg.training.overlap_grad_reduce,
        )
        self.model.to(self.dtype)
        self.optimizer.bind_grads()
        # the EMA of this rank's shard of the fp32 masters; evaluation gathers it
        self.ema = EMA([self.optimizer.master], ocfg.ema)
        self.scaler = DynamicLossScaler(
            ctx.device,
            init_scale=cfg.training.init_loss_scale,
            enabled=cfg.training.precision == "fp16",
        )
        self.loss_fn = TransducerLoss(cfg.loss.backend, self.model.blank_idx, cfg.loss.fused_gemm)
        # any kernel build happens here, before run_start
        loss_choice = self.loss_fn.prepare(self.model.joint)
        self.backends = training_choices(cfg, ctx.device, loss_choice, self.optimizer.backend)
        self.log.backends(backend_line(self.backends), self.backends)
        self.augment_generator = torch.Generator(device=ctx.device)
        self.augment_generator.manual_seed(self.seeds.augment)
        self.train_transform = BatchTransform(
            cfg.features, train=True, dtype=self.dtype, generator=self.augment_generator
        )
        self.eval_transform = BatchTransform(cfg.features, train=False, dtype=self.dtype)
        # Evaluation runs on a separate copy that receives the EMA weights in place, so graphs
        # captured on it stay valid and the training weights are never swapped out.
        self.eval_model = RNNT(cfg.model, cfg.eval.encoder_lstm).to(ctx.device, self.dtype).eval()
        self.decoder = build_decoder(cfg, self.eval_model)
        self.graphs = None
        if cfg.training.num_cg > 0:
            from rnnt.graphs import TrainingGraphs

            self.graphs = TrainingGraphs.for_config(
                self.model, cfg, self.data.train_utts, self.tokenizer
            )
        # device-side counters, read only at logging points
        self.skipped_total = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.skipped_in_a_row = torch.zeros((), dtype=torch.int64, device=ctx.device)
        peak, peak_source = peak_flops(ctx.device, cfg.training.peak_tflops)
        # the window counts every rank's utterances and FLOPs: so is the peak they are held to
        self.window = ThroughputWindow(
            ctx.device,
            peak * ctx.world_size if peak else None,
            getattr(self.train_loader, "data_wait_parts", None),
        )
        self._log_points: list[_LogPoint] = []
        # on a GPU a log point is read once the next step is queued, so that the GPU never runs
        # dry while the host logs; off it the step has run by the time train_step returns, and
        # its numbers are read at once
        self.defer_log_reads = ctx.device.type == "cuda"
        per_rank = f" per process x {ctx.world_size}" if ctx.world_size > 1 else ""
        self.log.info(
            "MFU against "
            + (
                f"{peak / 1e12:.1f} TFLOP/s{per_rank} ({peak_source})"
                if peak
                else f"nothing: {peak_source}"
            )
        )
        # CUDA events at the parts of each step, set by bench/train_step.py (None: no events)
        self.parts: StepParts | None = None

    def _broadcast_parameters(self) -> None:
        if self.ctx.enabled:
            import torch.distributed as dist

            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)

    # ---------------------------------------------------------------------------- state
    def _full_ema(self) -> list[torch.Tensor]:
        """The EMA of every parameter in model.parameters() order (a collective: every rank
        holds a shard of it)."""
        full = self.optimizer.gather(self.ema.weights[0])
        by_param = dict(zip(map(id, self.optimizer.params), self.optimizer.layout.views(full)))
        return [by_param[id(p)] for p in self.model.parameters()]

    def state_files(self) -> dict[str, dict]:
        """The files this rank writes into a checkpoint: its optimizer shard and random
        generators, and on rank 0 the model, the EMA and the run's position (a collective)."""
        files = {
            f"rank{self.ctx.rank}": {
                "optimizer": self.optimizer.state_dict(),
                "rng": capture_rng_state(),
                "augment_rng": self.augment_generator.get_state(),
                "loader": self.train_loader.generator_state(),
            }
        }
        ema = self._full_ema()
        if self.ctx.is_main:
            files["model"] = {
                "model": self.model.state_dict(),
                "ema": {"decay": self.ema.decay, "weights": ema},
                "scaler": self.scaler.state_dict(),
                "progress": {
                    "epoch": self.progress.epoch,
                    "step": self.progress.step,
                    "best_wer": self.progress.best_wer,
                },
                "sampler": self.train_loader.state_dict(),
                "skipped_total": self.skipped_total.cpu(),
                "skipped_in_a_row": self.skipped_in_a_row.cpu(),
                "config": to_dict(self.cfg),
                "world_size": self.ctx.world_size,
            }
        return files

    def load_state(
        self, states: dict[str, dict], checkpoint: Checkpoint, same_run: bool = True
    ) -> list[str]:
        """Load a checkpoint's states; returns the reasons the resume is not exact (none: it
        continues bit for bit as the run that saved it would have). same_run=False (another
        run's checkpoint, `start_from`): keep this run's id and draw its own random streams."""
        main = states["model"]
        try:
            self.model.load_state_dict(main["model"])
        except RuntimeError as err:  # missing keys or other shapes: another model config
            first = str(err).strip().splitlines()
            reason = first[1].strip() if len(first) > 1 else first[0]
            raise CheckpointError(
                f"{checkpoint.path}: its weights do not fit this config's model ({reason})"
            ) from None
        shards = [v["optimizer"] for k, v in states.items() if k.startswith("rank")]
        self.optimizer.load_state_dicts(shards)
        ema = main["ema"]
        self.ema.decay = float(ema["decay"])
        by_param = dict(zip(map(id, self.model.parameters()), ema["weights"]))
        full = torch.zeros(self.optimizer.layout.numel, device=self.ctx.device)
        torch._foreach_copy_(
            self.optimizer.layout.views(full), [by_param[id(p)] for p in self.optimizer.params]
        )
        self.ema.weights[0].copy_(self.optimizer.layout.shard_of(full, self.ctx.rank))
        self.scaler.load_state_dict(main["scaler"])
        p = main["progress"]
        self.progress = Progress(int(p["epoch"]), int(p["step"]), float(p["best_wer"]))
        try:
            self.train_loader.load_state_dict(main["sampler"])
        except SamplerStateError as err:
            raise SamplerStateError(
                f"{checkpoint.path}: {err}; resume with the manifests and batch settings it was "
                "trained with, or start a fresh run"
            ) from None
        self.skipped_total.copy_(main["skipped_total"])
        self.skipped_in_a_row.copy_(main["skipped_in_a_row"])
        if not same_run:
            self._seed_streams_at_step()
            return []
        self.run_id = checkpoint.meta.get("run_id", self.run_id)  # older checkpoints have none
        self.checkpoints.run_id = self.run_id
        return self._restore_streams(states.get(f"rank{self.ctx.rank}"), checkpoint)

    def _seed_streams_at_step(self) -> None:
        """Dropout's and SpecAugment's streams from this run's seed and the step (the loader's
        draws are a function of the seed and the position already)."""
        torch.manual_seed(self.seeds.torch + self.progress.step)
        self.augment_generator.manual_seed(self.seeds.augment + self.progress.step)

    def _restore_streams(self, own: dict | None, checkpoint: Checkpoint) -> list[str]:
        """Restore this rank's random streams; the reasons the resume is not exact, if any."""
        not_exact = []
        saved_world = checkpoint.record.get("world_size")
        if saved_world == self.ctx.world_size and own is not None:
            self.augment_generator.set_state(own["augment_rng"].cpu())
            restore_rng_state(own["rng"])
            if own.get("loader"):
                self.train_loader.load_generator_state(own["loader"])
            elif self.train_loader.generator_state():
                not_exact.append(
                    "the checkpoint holds no state of DALI's dither generator (it was written "
                    "before that was kept): dither restarts from the seed"
                )
        else:  # another world size: no rank's streams carry over, so derive them afresh
            not_exact.append(
                f"it was written by {saved_world} rank(s): the optimizer state was cut anew for "
                f"{self.ctx.world_size}, and the random streams restart from the seed and the step"
            )
            self._seed_streams_at_step()
        return not_exact

    def _files_to_load(self, checkpoint: Checkpoint) -> list[str]:
        """The model's file and this rank's optimizer shard, or every rank's where the
        checkpoint was written by another number of ranks (the state is cut anew)."""
        rank, world = self.ctx.rank, self.ctx.world_size
        if checkpoint.record.get("world_size") == world:
            return ["model", f"rank{rank}"]
        return ["model"] + [f"rank{r}" for r in range(checkpoint.record["world_size"])]

    def resume(self) -> bool:
        """Load the newest checkpoint of output_dir that every rank can read; False when there
        is none."""
        loaded = self.checkpoints.load_latest(
            self._files_to_load,
            map_location=self.ctx.device,
            agree=lambda ok: not any_rank(not ok, self.ctx),
        )
        if loaded is None:
            return False
        states, checkpoint = loaded
        not_exact = self.load_state(states, checkpoint)
        how = f"NOT exact: {'; '.join(not_exact)}" if not_exact else "exact"
        self.log.info(
            f"resumed from {checkpoint.path} at epoch {self.progress.epoch}, "
            f"step {self.progress.step}; {how}"
        )
        return True

    def start_from(self, path: str | Path) -> None:
        """Begin this fresh run where another run's checkpoint `path` left off: its weights,
        optimizer state, EMA, loss scale, epoch and step, and its place in the data (the data
        order's seed included). This run keeps its own id and output folder, and its random
        streams (dropout, SpecAugment, the loader's draws) come from its own seed and the step.
        Runs started from one checkpoint with other seeds or backends show how far training
        drifts from there alone (docs/CONVERGENCE.md)."""
        checkpoint = open_checkpoint(path)
        states, problem = {}, None
        try:
            for name in self._files_to_load(checkpoint):
                states[name] = checkpoint.load(name, self.ctx.device)
        except CheckpointError as err:
            problem = err
        if any_rank(problem is not None, self.ctx):
            raise problem or CheckpointError(f"{checkpoint.path}: unusable on another rank")
        self.load_state(states, checkpoint, same_run=False)
        self.log.info(
            f"started from {checkpoint.path} (run {checkpoint.meta.get('run_id', '?')}) after "
            f"its step {self.progress.step}, in epoch {self.progress.epoch}; random streams "
            f"from seed {self.cfg.training.seed}"
        )

    def save(self, wer: float | None = None, background: bool = False) -> Path:
        """Checkpoint the whole training state; every rank calls it at the same point and
        writes its own files. background: return once the state is in host memory and write
        the files while training goes on."""
        return self.checkpoints.save(
            self.state_files(),
            # named after the epochs it closes: ckpt_e5 holds the state after epoch 5 (a save
            # inside epoch 6 too); progress.epoch inside it is the epoch to run next
            epoch=self.progress.epoch - 1,
            step=self.progress.step,
            meta={"wer": wer, "seed": self.cfg.training.seed},  # and the run id
            background=background,
        )

    # ---------------------------------------------------------------------------- training
    def _forward_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, int]:
        """The loss of one micro-batch (a device scalar) and its model FLOPs."""
        parts = self.parts
        mb = self.train_transform(batch.to(self.ctx.device))
        if self.graphs is not None:
            f, f_lens, g = self.graphs(mb.feats, mb.feat_lens, mb.tokens)
        else:
            f, f_lens, g = self.model(mb.feats, mb.feat_lens, mb.tokens)
        host_lens = None
        if mb.host_lens is not None:
            frames, tokens = mb.host_lens
            host_lens = (self.model.encoded_lengths(frames).tolist(), tokens.tolist())
            flops = step_flops(self.cfg.model, frames.tolist(), host_lens[1])
        else:  # lengths only on the device: count the padded batch rather than read them
            t, b, u = mb.feats.shape[0], mb.feats.shape[1], mb.tokens.shape[1]
            flops = step_flops(self.cfg.model, [t] * b, [u] * b)
        if parts is not None:
            parts.mark("encoded")
            parts.mark_when_grads_reach([f, g], "joint_grads")
        loss = self.loss_fn(
            self.model.joint, f, g, f_lens, mb.tokens, mb.token_lens, host_lens=host_lens
        )
        if parts is not None:
            parts.mark("loss")
        return loss, flops

    def train_step(self, batch: FeatureBatch, lr: float) -> torch.Tensor:
        """One optimizer step on this rank's share of a global batch; returns the mean loss
        (a device tensor: no host sync here). The model FLOPs of the step are left in
        `last_step_flops`."""
        parts = self.parts
        if parts is not None:
            parts.mark("start")
        self.optimizer.parts = parts
        micro = _split(batch, self.cfg.training.grad_accumulation)
        # the optimizer sums gradients over ranks: each rank's share of the global mean
        divisor = len(micro) * self.ctx.world_size
        loss_sum = torch.zeros((), device=self.ctx.device)
        self.last_step_flops = 0
        for i, mb in enumerate(micro):
            if i == len(micro) - 1:
                self.optimizer.arm()  # this backward finishes the gradients: reduce them
            loss, flops = self._forward_loss(mb)
            self.scaler.scale_loss(loss / divisor).backward()
            loss_sum += loss.detach().float()
            self.last_step_flops += flops
        found_inf = self.optimizer.step(lr, self.scaler.grad_scale, loss_sum)
        self.scaler.update(found_inf)
        self.ema.update([self.optimizer.master])
        skipped = found_inf.to(torch.int64)
        self.skipped_total += skipped
        self.skipped_in_a_row.mul_(skipped).add_(skipped)
        if parts is not None:
            parts.mark("end")
        return loss_sum / len(micro)

    def _check_nonfinite(self, in_a_row: int, step: int) -> None:
        limit = self.cfg.training.max_consecutive_nonfinite
        if in_a_row >= limit:
            raise NonFiniteLossError(
                f"step {step}: {in_a_row} consecutive steps with a non-finite "
                f"loss or gradient (limit training.max_consecutive_nonfinite={limit}); "
                "the run stops"
            )

    def _queue_log_point(self, loss: torch.Tensor, lr: float) -> None:
        """Close the throughput window after this step and queue the copy of its scalars to
        the host, without waiting for the device: `_read_log_points` prints them once the next
        step is queued too, so that the GPU has work while the host logs and fetches the next
        batch."""
        scalars = [
            loss.detach().double().reshape(()),
            self.scaler.scale.double(),
            self.skipped_total.double(),
            self.skipped_in_a_row.double(),
        ]
        local = self._rank_flags()
        if self.ctx.enabled and local is not None:  # every rank learns every rank's
            shared = all_reduce_sum(to_device(local, self.ctx.device, torch.float64), self.ctx)
            scalars += shared.unbind()
            local = None
        values = torch.stack(scalars)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        host.copy_(values, non_blocking=True)  # before the window's end in the same stream
        self._log_points.append(
            _LogPoint(self.progress.step, self.progress.epoch, lr, host, self.window.close(), local)
        )

    def _rank_flags(self) -> list[float] | None:
        """This rank's [preemption signal, utterances dropped for unreadable audio]; None
        where neither is watched."""
        if self.preemption is None and not self.cfg.data.skip_bad:
            return None
        requested = self.preemption is not None and self.preemption.requested
        dropped = self.train_loader.dropped_utterances if self.cfg.data.skip_bad else 0
        return [float(requested), float(dropped)]

    def _read_log_points(self, before_step: int | None = None) -> None:
        """Print the queued log points of steps before `before_step` (all: None), waiting for
        each one's step to end on the device; stop the run after too many non-finite steps
        in a row, or at a preemption signal on any rank."""
        while self._log_points and (before_step is None or self._log_points[0].step < before_step):
            point = self._log_points.pop(0)
            window = point.window.stats()  # its step's end, and so the scalars' copy
            loss, scale, skipped_total, in_a_row, *summed = point.values.tolist()
            # [ranks with a preemption signal, utterances dropped], where either is watched
            flags = point.local_flags or summed or [0.0, 0.0]
            self.log.step(
                step=point.step,
                epoch=point.epoch,
                loss=loss,
                lr=point.lr,
                loss_scale=scale,
                skipped_steps=int(skipped_total),
                window=window,
                dropped_utterances=int(flags[1]) if self.cfg.data.skip_bad else None,
            )
            self._check_nonfinite(int(in_a_row), point.step)
            if flags[0] > 0:
                self._read_log_points()
                self._stop_preempted()

    def _stop_preempted(self) -> None:
        """A rank got a preemption signal (every rank learns it at the same log point): every
        rank saves its part of one checkpoint at this step boundary, waits for the others,
        and the run stops (train.py exits with EXIT_PREEMPTED)."""
        path = self.save()
        barrier(self.ctx)
        self.log.info(f"preempted: saved {path} at step {self.progress.step}; stopping")
        raise Preempted(str(path))

    def train_epoch(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        steps_per_epoch = len(self.train_loader)
        self.train_loader.set_epoch(self.progress.epoch)
        log_every = cfg.training.log_frequency
        batches = iter(
            self.log.progress(
                self.train_loader, total=steps_per_epoch, desc=f"epoch {self.progress.epoch}"
            )
        )
        self.window.start()
        loss = lr = None
        while True:
            self.profiler.before_step(self.progress.step + 1)
            waited = time.perf_counter()
            batch = next(batches, None)
            self.window.waited_for_data(time.perf_counter() - waited)
            if batch is None:
                break
            lr = lr_at(self.progress.step + 1, self.progress.epoch, steps_per_epoch, cfg.optimizer)
            loss = self.train_step(batch, lr)
            self.progress.step += 1
            if self.progress.step % steps_per_epoch == steps_per_epoch // 2:
                self._read_dev_set_ahead()
            self._say(self.profiler.after_step(self.progress.step))
            self.window.add_step(len(batch) * ctx.world_size, self.last_step_flops * ctx.world_size)
            if self.progress.step % log_every == 0:
                self._queue_log_point(loss, lr)
            self._read_log_points(before_step=self.progress.step if self.defer_log_reads else None)
            every = cfg.training.checkpoint_every_steps
            if every and self.progress.step % every == 0:
                self.save(background=True)
            every = cfg.training.eval_every_steps
            at_epoch_end = self.progress.step % steps_per_epoch == 0  # evaluated there anyway
            if every and self.progress.step % every == 0 and not at_epoch_end:
                self._evaluate_mid_epoch(loss, lr)
        if self.window.steps:  # the epoch's last, shorter window
            self._queue_log_point(loss, lr)
        self._read_log_points()

    def _evaluate_mid_epoch(self, loss: torch.Tensor, lr: float) -> None:
        """Score the dev set at this step (`training.eval_every_steps`): the throughput
        window closes before it and starts again after it, so no logged step holds its time."""
        if self.window.steps:
            self._queue_log_point(loss, lr)
        self._read_log_points()
        self._score_dev_set(mid_epoch=True)
        self.window.start()

    def _score_dev_set(self, mid_epoch: bool = False) -> EvalResult:
        """`run_eval`, logged (an epoch's own evaluation, or one inside the epoch)."""
        retries_before = self.window.alloc_retries()
        result = self.run_eval()
        self.log.eval(
            epoch=self.progress.epoch,
            step=self.progress.step,
            wer=result.wer,
            utterances=result.utterances,
            seconds=result.seconds,
            data_seconds=result.data_seconds,
            alloc_retries=None
            if retries_before is None
            else self.window.alloc_retries() - retries_before,
            mid_epoch=mid_epoch,
        )
        return result

    def _read_dev_set_ahead(self) -> None:
        """Start the dev set's first pass halfway through the first epoch: begun at the first
        evaluation, the workers' start and first batches cost it seconds of waiting (4.4 of
        its 6.5 s on an H200), and at the run's start they would compete with the training
        loader's own start. Later passes follow on their own (the loader reads ahead)."""
        start_reading = getattr(self.data.val, "read_ahead", None)  # the torch loader's
        if start_reading is not None:
            start_reading()

    def _say(self, line: str | None) -> None:
        if line is not None:
            self.log.info(line)

    def run_eval(self) -> EvalResult:
        with torch.no_grad():
            torch._foreach_copy_(list(self.eval_model.parameters()), self._full_ema())
        return evaluate(
            self.decoder,
            self.data.val,
            self.eval_transform,
            detokenizer(self.tokenizer),
            self.ctx,
        )

    def warm_up(self) -> None:
        """Launch, before the clock starts, what would otherwise compile at the run's first
        steps: the Triton kernels of LAMB, of the loss (at the label tiles of the training
        set's longest transcripts) and of the feature stage (seconds each in a fresh
        container, whose kernel caches are cold). MLPerf allows such model
        initialization before run_start but not touching the data, so all of it runs on
        stand-in tensors, and the global random generators are put back: the run trains
        exactly as it would have without."""
        start = time.perf_counter()
        device = self.ctx.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.optimizer.warm_up()
            if self.loss_fn.compiles_kernels:  # the longest transcript costs a tokenizer pass
                self.loss_fn.warm_up(self.model.joint, self._longest_tokens())
            for loader in (self.train_loader, self.data.val):
                warm_up = getattr(loader, "warm_up", None)
                if warm_up is not None:
                    warm_up()
            self._warm_up_evaluation()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.log.info(f"warm-up before run_start: {time.perf_counter() - start:.1f} s")

    def _longest_tokens(self) -> int:
        if self.graphs is not None:  # sized its prediction buckets by it
            return max(self.graphs.token_buckets)
        from rnnt.graphs import longest_transcript

        return longest_transcript(self.data.train_utts, self.tokenizer)

    def _warm_up_evaluation(self) -> None:
        """The evaluation model and decoder once on a stand-in batch of the dev set's longest
        shape: the decoder's graphs are captured at the size the first evaluation needs (its
        first batch holds the longest utterances), and the encoder's first call at that shape
        is made. The rows are one frame long, so the decoding itself ends at once. The graphs
        read the evaluation model's parameters by address; each evaluation copies the EMA
        into them in place. Off CUDA there are no graphs or kernel plans to prepare, only the
        decoder's buffers (sized by eval.batch_size whatever the stand-in's rows), so one row
        does: the full model's encoder over 338 rows of 32 s took minutes on a 2-core CPU."""
        fcfg = self.cfg.features
        samples = torch.tensor([math.ceil(self.data.val_longest * fcfg.sample_rate)])
        frames = num_frames(samples, window_samples(fcfg)[1])
        spliced = int(spliced_length(frames, fcfg.frame_subsample))
        batch = self.cfg.eval.batch_size if self.ctx.device.type == "cuda" else 1
        feats = torch.zeros(
            spliced, batch, self.cfg.model.in_feats, dtype=self.dtype, device=self.ctx.device
        )
        self.decoder(feats, torch.ones(batch, dtype=torch.int64, device=self.ctx.device))

    def fit(self) -> bool:
        """Train to the target; returns True when the target WER was reached."""
        cfg, ml = self.cfg, self.mlperf
        ml.hyperparameters(
            cfg,
            global_batch_size=self.global_batch,
            train_samples=len(self.data.train_utts),
            eval_samples=self.data.val_size,
            grad_accumulation=cfg.training.grad_accumulation,
        )
        self.warm_up()
        ml.init_stop()
        ml.run_start()
        reached = False
        status = "aborted"
        result: EvalResult | None = None
        try:
            while self.progress.epoch <= cfg.training.epochs:
                epoch = self.progress.epoch
                ml.block_start(epoch)
                ml.epoch_start(epoch)
                self.train_epoch()
                ml.epoch_stop(epoch)
                ml.eval_start(epoch)
                result = self._score_dev_set()
                ml.eval_accuracy(result.wer, epoch)
                ml.eval_stop(epoch)
                ml.block_stop(epoch)
                self.progress.best_wer = min(self.progress.best_wer, result.wer)
                target = cfg.training.target_wer
                reached = target > 0 and result.wer <= target
                self.progress.epoch += 1
                if reached:
                    break
                every = cfg.training.save_every_epochs
                if every and epoch % every == 0 and self.progress.epoch <= cfg.training.epochs:
                    self.save(result.wer, background=True)
            status = "success" if reached else "aborted"
        finally:
            ml.run_stop(status)
            self._say(self.profiler.close())
            self.checkpoints.wait()
        # the final state, after the timed region (a run that raised keeps its last checkpoint)
        self.save(result.wer if result is not None else None)
        # no rank leaves before rank 0 has committed it: a launcher that sees one rank exit
        # may kill the others
        barrier(self.ctx)
        return reached


def check_system(cfg: Config, world_size: int, global_batch: int) -> None:
    """The run matches its config: as many ranks as `system` names, and the global batch of
    the GBS preset whose hyperparameters it trains with (unless the config says it is meant)."""
    system = cfg.system
    ranks = system.nodes * system.gpus_per_node
    if ranks and ranks != world_size:
        raise ConfigError(
            f"system: the config is for {system.nodes} node(s) x {system.gpus_per_node} GPUs = "
            f"{ranks} ranks, but this run has {world_size}; launch it so, or pick the overlay "
            "of this machine in configs/systems/"
        )
    preset = cfg.optimizer.preset
    if preset and preset_global_batch(preset) != global_batch:
        if not cfg.optimizer.allow_gbs_mismatch:
            raise ConfigError(
                f"optimizer.preset: {preset} holds the hyperparameters of a global batch of "
                f"{preset_global_batch(preset)}, but this run's is {global_batch} "
                f"(training.batch_size {cfg.training.batch_size} x grad_accumulation "
                f"{cfg.training.grad_accumulation} x {world_size} ranks); pick the preset of "
                "its size, or set optimizer.allow_gbs_mismatch=true if that is meant"
            )


def _split(batch: FeatureBatch, parts: int) -> list[FeatureBatch]:
    if parts == 1:
        return [batch]
    size = math.ceil(len(batch) / parts)
    out = []
    for i in range(0, len(batch), size):
        sl = slice(i, i + size)
        lens, tlens = batch.feat_lens[sl], batch.token_lens[sl]
        out.append(
            FeatureBatch(
                batch.feats[sl],
                lens,
                batch.tokens[sl],
                tlens,
                batch.utt_ids[sl],
                batch.transcripts[sl],
                None if batch.host_lens is None else tuple(x[sl] for x in batch.host_lens),
            )
        )
    return out
