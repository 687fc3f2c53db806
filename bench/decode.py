"""Greedy decoding throughput of every `GreedyDecoder` mode on the dev-clean utterance shapes.

    python bench/decode.py --device cuda                       # the 49M model, full dev-clean
    python bench/decode.py configs/tiny.yaml --device cpu --limit 16 --batch-sizes 8

Inputs are random features with the exact lengths of the 2,703 dev-clean utterances (encoder
frames = ceil(ceil(ceil(duration * 100) / 3) / 2)), batched as the evaluation batches the dev set
(`rnnt.data.sampler.SequentialBatches`: longest first, so each batch pads to a near length; the
padding left is reported per batch size). The encoder runs once per batch (timed separately);
each mode then decodes cached encoder
outputs (see Emissions). One untimed warm-up pass (it includes the CUDA graph captures) precedes
`--repeats` timed passes; the table shows the median pass. GPU timings use CUDA events.

Emissions: decoding cost grows with the symbols emitted (one step per symbol plus one per
frame). With `--checkpoint` the trained weights decide, on encoder outputs of noise. Without
one, the prediction and joint networks are trained for `--train-steps` steps on synthetic
encoder outputs with a known alignment (`SyntheticAlignments`): each utterance gets one label
frame per token of its real transcript (tokens from the configured tokenizer, else from one
trained on these transcripts, else words), and those synthetic outputs are what is decoded.
The output reports the symbols per frame actually decoded.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rnnt.config import load_config_or_exit
from rnnt.data.sampler import SequentialBatches
from rnnt.data.text import normalize_transcript
from rnnt.data.tokenizer import Tokenizer, TokenizerError, train_tokenizer
from rnnt.decoding import MODES, GreedyDecoder, decode_reference
from rnnt.model import RNNT

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def read_lengths(path: Path) -> tuple[list[float], list[str]]:
    """(durations in seconds, normalized transcripts) of a `utt_id<TAB>duration<TAB>text` file."""
    durations, texts = [], []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        try:
            durations.append(float(fields[1]))
        except (IndexError, ValueError):
            raise SystemExit(
                f"{path}:{lineno}: expected utt_id<TAB>duration<TAB>transcript"
            ) from None
        texts.append(normalize_transcript(fields[2]) if len(fields) > 2 else "")
    return durations, texts


def spliced_frames(duration: float, splice: int) -> int:
    """10 ms feature frames after stacking/subsampling by `splice`."""
    return math.ceil(math.ceil(round(duration * 100, 6)) / splice)


def count_tokens(texts: list[str], cfg, tokenizer_path: str) -> tuple[list[int], str]:
    """Tokens of each transcript, and how they were counted."""
    path = Path(tokenizer_path or cfg.data.tokenizer)
    if not path.is_absolute():
        path = ROOT / path
    if path.is_file():
        tok = Tokenizer(path)
        return [len(tok.sp.encode(t)) for t in texts], f"tokenizer {path}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tok = Tokenizer(train_tokenizer(texts, Path(tmp) / "sp", cfg.model.n_classes - 1))
        except TokenizerError:
            return [len(t.split()) for t in texts], "words (no tokenizer could be built)"
        how = f"a {cfg.model.n_classes - 1}-piece unigram tokenizer trained on these transcripts"
        return [len(tok.sp.encode(t)) for t in texts], how


def _at_label(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g (B, U+1, H), u (B, T) label counts -> (B, T, H) prediction output after u labels."""
    u = u.clamp(max=g.shape[1] - 1)
    return g.gather(1, u.unsqueeze(-1).expand(-1, -1, g.shape[2]))


class SyntheticAlignments:
    """Encoder outputs with a known alignment, to give random weights realistic emissions.

    Utterance b gets `tokens[b]` label frames at random positions among its `frames[b]`
    frames; a label frame holds the label's random code vector plus noise, every other frame
    noise only. The joint and prediction networks are then trained briefly (cross-entropy,
    teacher forcing) to emit the label on its frame and blank right after it and on noise, so
    greedy decoding emits about one symbol per label frame, like a trained model on speech.
    """

    def __init__(self, n_classes: int, hidden: int, noise: float, gen: torch.Generator) -> None:
        self.blank = n_classes - 1
        self.n_classes = n_classes
        self.codes = torch.randn(n_classes, hidden, generator=gen)
        self.noise = noise
        self.gen = gen

    def batch(self, frames: list[int], tokens: list[int]):
        """-> f (B, T, H), f_lens (B,), labels (B, U) blank-padded, label_at (B, T) (-1: none)."""
        batch, max_t = len(frames), max(frames)
        f = self.noise * torch.randn(batch, max_t, self.codes.shape[1], generator=self.gen)
        labels = torch.full((batch, max(max(tokens), 1)), self.blank)
        label_at = torch.full((batch, max_t), -1)
        for b, (t, u) in enumerate(zip(frames, tokens)):
            u = min(u, t)
            pos = torch.randperm(t, generator=self.gen)[:u].sort().values
            ids = torch.randint(1, self.n_classes - 1, (u,), generator=self.gen)  # no <unk>
            label_at[b, pos] = ids
            labels[b, :u] = ids
        is_label = label_at >= 0
        f[is_label] += self.codes[label_at[is_label]]
        f[torch.arange(max_t)[None, :] >= torch.tensor(frames)[:, None]] = 0
        return f, torch.tensor(frames), labels, label_at

    def train(self, model: RNNT, steps: int, rate: float, device) -> float:
        """Fit model.prediction and model.joint to the alignments; returns the last loss."""
        params = [*model.prediction.parameters(), *model.joint.parameters()]
        opt = torch.optim.Adam(params, lr=3e-3)
        loss = torch.zeros(())
        for _ in range(steps):
            frames = torch.randint(20, 120, (64,), generator=self.gen).tolist()
            f, f_lens, labels, label_at = (
                t.to(device) for t in self.batch(frames, [round(rate * t) for t in frames])
            )
            g = model.predict(labels)  # (B, U+1, H): g[:, u] follows the first u labels
            is_label = label_at >= 0
            before = is_label.long().cumsum(1) - is_label.long()  # labels before each frame
            valid = torch.arange(f.shape[1], device=device)[None, :] < f_lens[:, None]
            # the first evaluation at each frame: its label, or blank on a noise frame
            first = model.joint.step(f, _at_label(g, before))[valid]
            target = torch.where(is_label, label_at, self.blank)[valid]
            # the evaluation right after emitting a frame's label: blank
            after = model.joint.step(f, _at_label(g, before + 1))[valid & is_label]
            blanks = torch.full((after.shape[0],), self.blank, device=device)
            ce = torch.nn.functional.cross_entropy
            loss = ce(first, target) + ce(after, blanks)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()


class Timer:
    """Seconds of a region: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(True), torch.cuda.Event(True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def make_batches(spliced: list[int], plan: list[list[int]], in_feats: int, device, dtype, gen):
    """Random features (T, B, in_feats), zero past each length, one batch per list of `plan`."""
    for rows in plan:
        lens = torch.tensor([spliced[i] for i in rows])
        feats = torch.randn(int(lens.max()), len(lens), in_feats, generator=gen)
        feats[torch.arange(feats.shape[0])[:, None] >= lens[None, :]] = 0
        yield feats.to(device, dtype), lens.to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs/baseline_v3-1023sp.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: fp16 on cuda, fp32 on cpu")
    parser.add_argument("--lengths", help="default: the config's data.synthetic_val_lengths")
    parser.add_argument("--limit", type=int, default=0, help="first N utterances only")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 338])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-sample", type=int, default=16, help="utterances")
    parser.add_argument("--checkpoint", help="model weights (state_dict, or a dict with 'model')")
    parser.add_argument("--tokenizer", default="", help="counts the tokens per utterance")
    parser.add_argument(
        "--train-steps", type=int, default=300, help="synthetic-alignment training steps"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("fp16" if device.type == "cuda" else "fp32")]
    lengths = Path(args.lengths or cfg.data.synthetic_val_lengths)
    if not lengths.is_absolute():
        lengths = ROOT / lengths
    durations, texts = read_lengths(lengths)
    if args.limit:
        durations, texts = durations[: args.limit], texts[: args.limit]
    spliced = [spliced_frames(d, cfg.features.frame_subsample) for d in durations]
    stack = cfg.model.enc_stack_time_factor
    frames = [-(-t // stack) for t in spliced]  # encoder frames

    torch.manual_seed(args.seed)
    model = RNNT(cfg.model, cfg.eval.encoder_lstm)  # --set eval.encoder_lstm=wave times the kernels
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("model", state))
    gen = torch.Generator().manual_seed(args.seed)
    model.to(device)
    if args.checkpoint:
        emissions = f"trained weights from {args.checkpoint}, decoding encoder outputs of noise"
    else:
        tokens, how = count_tokens(texts, cfg, args.tokenizer)
        target = sum(tokens) / sum(frames)
        synthetic = SyntheticAlignments(cfg.model.n_classes, cfg.model.joint_n_hid, 0.3, gen)
        loss = synthetic.train(model, args.train_steps, target, device)
        emissions = (
            f"random encoder weights; prediction+joint trained {args.train_steps} steps "
            f"(final loss {loss:.3f}) on synthetic encoder outputs with one label frame per "
            f"token of each dev-clean transcript ({how}: {target:.4f} tokens per frame)"
        )
        # one draw per utterance, shared by every batch size
        synthetic_f = [synthetic.batch([t], [u])[0][0] for t, u in zip(frames, tokens)]
    model = model.to(dtype).eval()
    blank = model.blank_idx
    n_utts = len(frames)
    result: dict = {
        "config": args.config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "utterances": n_utts,
        "encoder_frames": sum(frames),
        "max_symbols_per_step": cfg.eval.max_symbols_per_step,
        "max_symbols_per_utterance": cfg.eval.max_symbols_per_utterance,
        "cg_unroll_factor": cfg.eval.cg_unroll_factor,
        "encoder_lstm": cfg.eval.encoder_lstm,
        "rows": [],
    }

    plans = {bs: SequentialBatches(durations, bs).plan for bs in args.batch_sizes}
    result["encoder_padding"] = {
        bs: 1 - sum(frames) / sum(len(rows) * max(frames[i] for i in rows) for rows in plan)
        for bs, plan in plans.items()
    }
    encoded_by_bs: dict[int, list] = {}
    encode_s: dict[int, float] = {}
    for bs in args.batch_sizes:
        batches, total = [], 0.0
        for i, (feats, lens) in enumerate(
            make_batches(spliced, plans[bs], cfg.model.in_feats, device, dtype, gen)
        ):
            if i == 0:
                with torch.no_grad():
                    model.encode(feats, lens)  # untimed: cuDNN/allocator warm-up
            with Timer(device) as t, torch.no_grad():
                batches.append(model.encode(feats, lens))
            total += t.seconds
        if not args.checkpoint:  # decode the synthetic alignments instead
            batches = []
            for rows in plans[bs]:
                f = torch.nn.utils.rnn.pad_sequence(
                    [synthetic_f[i] for i in rows], batch_first=True
                )
                lens = torch.tensor([frames[i] for i in rows], device=device)
                batches.append((f.to(device, dtype), lens))
        encoded_by_bs[bs], encode_s[bs] = batches, total

    hyps: dict[tuple[str, int], list] = {}
    for bs in args.batch_sizes:
        for mode in args.modes:
            decoder = GreedyDecoder(
                model,
                blank,
                cfg.eval.max_symbols_per_step,
                cfg.eval.max_symbols_per_utterance,
                mode=mode,
                batch_size=bs,
                unroll_factor=cfg.eval.cg_unroll_factor,
                max_frames=max(frames),
            )
            passes = []
            for rep in range(args.repeats + 1):  # pass 0: warm-up and graph capture
                out, seconds = [], 0.0
                for f, f_lens in encoded_by_bs[bs]:
                    with Timer(device) as t:
                        out.extend(decoder.decode(f, f_lens))
                    seconds += t.seconds
                if rep:
                    passes.append(seconds)
            by_utterance: list = [None] * n_utts  # batch sizes batch the utterances apart
            for i, hyp in zip((i for rows in plans[bs] for i in rows), out):
                by_utterance[i] = hyp
            hyps[(mode, bs)] = by_utterance
            median = statistics.median(passes)
            result["rows"].append(
                {
                    "mode": mode,
                    "batch_size": bs,
                    "utterances": n_utts,
                    "decode_s": median,
                    "utt_per_s": n_utts / median,
                    "encode_s": encode_s[bs],
                    "utt_per_s_with_encoder": n_utts / (median + encode_s[bs]),
                    "symbols": sum(map(len, out)),
                    "passes_s": passes,
                }
            )
    # Modes must agree on the same batches; different batch sizes run different GEMM shapes,
    # which may round differently in fp16, so their agreement is only reported.
    result["modes_identical"] = {
        bs: all(hyps[(mode, bs)] == hyps[(args.modes[0], bs)] for mode in args.modes)
        for bs in args.batch_sizes
    }
    first = hyps[(args.modes[0], args.batch_sizes[0])]
    result["batch_sizes_agree"] = all(h == first for h in hyps.values())
    symbols = sum(map(len, first))
    result["emissions"] = f"{emissions}; decoded: {symbols / sum(frames):.4f} symbols per frame"
    result["utterances_at_symbol_limit"] = sum(
        len(h) == cfg.eval.max_symbols_per_utterance for h in first
    )

    sample = min(args.reference_sample, n_utts)
    if sample:
        f, f_lens = encoded_by_bs[args.batch_sizes[0]][0]
        sample = min(sample, f.shape[0])
        with Timer(device) as t:
            ref = decode_reference(
                model,
                f[:sample],
                f_lens[:sample],
                blank,
                cfg.eval.max_symbols_per_step,
                cfg.eval.max_symbols_per_utterance,
            )
        result["rows"].append(
            {
                "mode": "reference",
                "batch_size": 1,
                "utterances": sample,
                "decode_s": t.seconds,
                "utt_per_s": sample / t.seconds,
                "symbols": sum(map(len, ref)),
                "matches_batched": ref
                == [first[i] for i in plans[args.batch_sizes[0]][0][:sample]],
            }
        )

    print(result["emissions"])
    where = f"{result['device']}, {result['dtype']}, encoder {result['encoder_lstm']}"
    print(f"{n_utts} utterances, {where}")
    padding = ", ".join(f"{100 * v:.1f}% at {bs}" for bs, v in result["encoder_padding"].items())
    print(f"encoder frames that are padding: {padding}")
    print(
        f"{'mode':<20}{'batch':>6}{'utts':>6}{'decode s':>10}{'utt/s':>10}"
        f"{'+enc utt/s':>12}{'symbols':>9}"
    )
    for row in result["rows"]:
        print(
            f"{row['mode']:<20}{row['batch_size']:>6}{row['utterances']:>6}"
            f"{row['decode_s']:>10.4f}{row['utt_per_s']:>10.1f}"
            f"{row.get('utt_per_s_with_encoder', float('nan')):>12.1f}{row['symbols']:>9}"
        )
    print(f"modes identical per batch size: {result['modes_identical']}")
    print(f"all batch sizes agree: {result['batch_sizes_agree']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
