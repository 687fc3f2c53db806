"""GPU time of the torch loader's feature stage and of its Triton kernels against their references.

On one padded batch of noise at a LibriSpeech-like width (default 192 x 16.7 s at 16 kHz,
lengths from half the width to all of it), timed with CUDA events, medians of the repeats:
- the speed perturbation, `rnnt.data.features.resample`: the Triton resampler against the
  float64 reference, with the largest difference;
- the silence trim, `trim_silence`, on the resampled batch: the Triton kernels against the
  float64 reference, and whether they kept the same samples;
- the log and the per-utterance normalization of a mel batch of the same size: the Triton
  kernel against the reference's operations, with the largest difference;
- the whole stage, `FeatureExtractor` in training mode on int16 samples, as the loader runs it
  (the lengths and speeds on the host: frames packed to each utterance's bound), with the
  speeds drawn on the GPU (bound at the slowest speed), and with the lengths on the GPU
  (frames padded),
  and without the speed perturbation with its Triton kernels on and off;
- the power and the mel product in one kernel against the power's kernel and cuBLAS;
- the resampler at each launch shape (output samples per program x warps, the shapes taking
  turns), the default marked;
- with --profile, the whole stage's kernels as the loader runs it, each one's GPU time a batch
  (torch.profiler over the repeats), longest first.

    python bench/feature_stage.py [--batch 192] [--seconds 16.7] [--repeats 10] [--profile]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from rnnt.config import FeaturesConfig
from rnnt.data.features import (
    NORM_EPSILON,
    RESAMPLE_LOBES,
    FeatureExtractor,
    draw_speeds,
    frames_bound,
    hann_window,
    mel_basis,
    normalize,
    resample,
    trim_silence,
)
from rnnt.kernels import resample as kernel_module
from rnnt.kernels.frames import frame_power_packed, mel_tiles
from rnnt.kernels.log_normalize import log_normalize_cuda


def time_ms(fn, repeats: int) -> float:
    fn()  # compile and allocate
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=192)
    parser.add_argument("--seconds", type=float, default=16.7)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="the stage's kernels, timed")
    args = parser.parse_args()
    cfg = FeaturesConfig()
    width = round(args.seconds * cfg.sample_rate)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(width // 2, width + 1, (args.batch,), generator=gen)
    wave = (torch.randn(args.batch, width, generator=gen) * 0.1).cuda()
    wave *= torch.arange(width, device="cuda")[None] < lengths.cuda()[:, None]
    ratio = 1.0 / draw_speeds(cfg, args.batch, gen)
    ratio_range = (1.0 / cfg.speed_perturbation_max, 1.0 / cfg.speed_perturbation_min)
    lengths = lengths.cuda()
    kernel = time_ms(lambda: resample(wave, lengths, ratio, ratio_range), args.repeats)
    reference = time_ms(
        lambda: resample(wave, lengths, ratio, ratio_range, use_kernel=False), args.repeats
    )
    got, got_lens = resample(wave, lengths, ratio, ratio_range)
    ref, _ = resample(wave, lengths, ratio, ratio_range, use_kernel=False)
    print(
        f"{args.batch} x {args.seconds} s on {torch.cuda.get_device_name()}: Triton "
        f"{kernel:.2f} ms, reference {reference:.2f} ms ({reference / kernel:.1f}x); "
        f"max |difference| {(got - ref).abs().max().item():.2e}"
    )
    pcm = (wave * 32768).round().clamp(-32768, 32767).to(torch.int16)
    from_pcm = time_ms(lambda: resample(pcm, lengths, ratio, ratio_range), args.repeats)
    converted = time_ms(
        lambda: resample(pcm * (1.0 / 32768), lengths, ratio, ratio_range), args.repeats
    )
    same = torch.equal(
        resample(pcm, lengths, ratio, ratio_range)[0],
        resample(pcm * (1.0 / 32768), lengths, ratio, ratio_range)[0],
    )
    print(
        f"resampler on int16 PCM: {from_pcm:.2f} ms, against {converted:.2f} ms converting to "
        f"float32 first (the conversion included); the same output: {same}"
    )
    cutoff_db = cfg.silence_threshold_db
    trim_kernel = time_ms(lambda: trim_silence(got, got_lens, cutoff_db), args.repeats)
    trim_reference = time_ms(
        lambda: trim_silence(got, got_lens, cutoff_db, use_kernel=False), args.repeats
    )
    kept, kept_lens = trim_silence(got, got_lens, cutoff_db)
    kept_ref, kept_ref_lens = trim_silence(got, got_lens, cutoff_db, use_kernel=False)
    same = torch.equal(kept, kept_ref) and torch.equal(kept_lens, kept_ref_lens)
    print(
        f"silence trim: Triton {trim_kernel:.2f} ms, reference {trim_reference:.2f} ms "
        f"({trim_reference / trim_kernel:.1f}x); same samples kept: {same}"
    )
    # the log and the normalization of a mel batch of this size (frames as the stage makes
    # them, 80 bins), lengths from the utterances'
    hop = round(cfg.window_stride * cfg.sample_rate)
    frame_lens = lengths // hop + 1
    mel = torch.rand(args.batch, width // hop + 1, cfg.n_mels, device="cuda")
    mel = mel**4 * 100
    log_norm_kernel = time_ms(
        lambda: log_normalize_cuda(mel, frame_lens, cfg.log_floor, NORM_EPSILON), args.repeats
    )

    def log_norm_reference():
        logmel = torch.log(torch.clamp(mel, min=cfg.log_floor)).transpose(1, 2)
        return normalize(logmel, frame_lens)

    log_norm_ref = time_ms(log_norm_reference, args.repeats)
    difference = log_normalize_cuda(mel, frame_lens, cfg.log_floor, NORM_EPSILON)
    difference = (difference - log_norm_reference()).abs().max().item()
    print(
        f"log and normalization: Triton {log_norm_kernel:.2f} ms, reference {log_norm_ref:.2f} ms "
        f"({log_norm_ref / log_norm_kernel:.1f}x); max |difference| {difference:.2e}"
    )
    stage_gen = torch.Generator(device="cuda").manual_seed(0)
    extractor = FeatureExtractor(cfg, train=True).cuda()
    host_lengths = lengths.cpu()
    host_speeds = draw_speeds(cfg, args.batch, gen)
    stage = time_ms(lambda: extractor(pcm, host_lengths, stage_gen, host_speeds), args.repeats)
    slowest = time_ms(lambda: extractor(pcm, host_lengths, stage_gen), args.repeats)
    padded_stage = time_ms(lambda: extractor(pcm, lengths, stage_gen), args.repeats)
    print(
        f"the whole stage (FeatureExtractor, training mode, int16 in): {stage:.2f} ms as the "
        f"loader runs it (lengths and speeds on the host: each utterance's frames packed to "
        f"its bound at its speed), {slowest:.2f} ms with the speeds drawn on the GPU (bound at "
        f"the slowest speed), {padded_stage:.2f} ms with the lengths on the GPU (every "
        f"utterance framed to the longest)"
    )
    if args.profile:
        profile_stage(lambda: extractor(pcm, host_lengths, stage_gen, host_speeds), args.repeats)
    # without the speed perturbation, whose float64 reference would dwarf the rest
    unperturbed = FeatureExtractor(cfg, train=True, speed_perturb=False).cuda()
    with_kernels = time_ms(lambda: unperturbed(pcm, lengths, stage_gen), args.repeats)
    unperturbed.use_kernels = False
    with_references = time_ms(lambda: unperturbed(pcm, lengths, stage_gen), args.repeats)
    print(
        f"the stage without speed perturbation: Triton trim, framing, log and normalization "
        f"{with_kernels:.2f} ms, "
        f"reference functions {with_references:.2f} ms ({with_references / with_kernels:.1f}x)"
    )
    # the power and the mel product: one kernel against the power's kernel and cuBLAS's
    # product, on the resampled batch's frames packed to the stage's bound (framing and FFT
    # included in both)
    rows = frames_bound(lengths.cpu(), ratio_range[1], hop)
    window = hann_window(round(cfg.window_size * cfg.sample_rate)).cuda()
    framing = (got, got_lens, None, 0.0, cfg.preemph, window, hop, cfg.n_fft, rows)
    basis = mel_basis(cfg).cuda()
    tiles = mel_tiles(basis, "cuda")
    separate = time_ms(lambda: torch.matmul(frame_power_packed(*framing)[0], basis.T), args.repeats)
    fused = time_ms(lambda: frame_power_packed(*framing, mel=tiles), args.repeats)
    difference = frame_power_packed(*framing, mel=tiles)[0] - torch.matmul(
        frame_power_packed(*framing)[0], basis.T
    )
    print(
        f"framing, FFT, power and mel product of {int(rows.sum())} packed frames: the power "
        f"and the mel product in one kernel {fused:.2f} ms, the power's kernel then cuBLAS "
        f"{separate:.2f} ms; max |difference| {difference.abs().max().item():.2e}"
    )
    half = math.ceil(RESAMPLE_LOBES / ratio_range[0])
    out_lens = torch.ceil(lengths.double() * ratio.cuda()).long()
    default = (kernel_module.BLOCK, kernel_module.NUM_WARPS)
    # 1 to 4 output samples a thread (more spill registers); the shapes take turns within each
    # round, so that the GPU's clocks and the other shapes' caches treat them alike
    shapes = [
        (block, warps)
        for block in (128, 256, 512, 1024)
        for warps in (2, 4, 8)
        if 32 * warps <= block <= 4 * 32 * warps
    ]

    def launch(block: int, warps: int) -> torch.Tensor:
        return kernel_module.resample_cuda(
            wave,
            lengths,
            out_lens,
            ratio.cuda(),
            got.shape[1],
            half,
            RESAMPLE_LOBES,
            block=block,
            num_warps=warps,
        )

    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for shape in shapes:
        launch(*shape)  # compile
    for _ in range(args.repeats):
        for shape in shapes:
            times[shape].append(time_ms(lambda shape=shape: launch(*shape), 1))
    for (block, warps), ms in times.items():
        mark = " (default)" if (block, warps) == default else ""
        same = torch.equal(launch(block, warps), got)
        print(
            f"  {block:4d} samples x {warps} warps: {statistics.median(ms):7.2f} ms{mark}"
            f"{'' if same else ', NOT the default launch output'}"
        )


def profile_stage(stage, repeats: int) -> None:
    """Each kernel of `stage` (a callable), its GPU time a call, longest first."""
    from torch.profiler import ProfilerActivity, profile

    stage()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            stage()
        torch.cuda.synchronize()
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total, count = kernels.get(event.name, (0.0, 0))
        kernels[event.name] = (total + event.device_time_total / 1000, count + 1)
    print(f"the stage's kernels as the loader runs it, GPU ms a batch ({repeats} batches):")
    for name, (total, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"  {total / repeats:7.3f} ms  {count / repeats:4.1f} a batch  {name[:90]}")
    print(f"  {sum(t for t, _ in kernels.values()) / repeats:7.3f} ms  in all")


if __name__ == "__main__":
    main()
