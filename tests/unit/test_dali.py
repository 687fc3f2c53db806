"""DALI pipeline against the torch-native front end (the reference) and librosa.

Audio: espeak-ng utterances from the synthetic corpus generator, and "recorded-like" versions
of espeak-ng speech (sox: room reverb, high-pass, 16-bit) with noise, since this machine has no
real recordings.
"""

from __future__ import annotations

import math
import subprocess
import threading

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

from rnnt.config import Config
from rnnt.data.dali import TRIM_RESET_INTERVAL
from rnnt.data.features import AudioFileError, FeatureExtractor, read_audio, trim_silence
from rnnt.data.loader import build_loader
from rnnt.data.manifest import Utterance
from rnnt.data.sampler import BucketingSampler
from rnnt.prep.synthetic_corpus import plan_split, synthesize

dali = pytest.importorskip("nvidia.dali")
from nvidia.dali import fn, pipeline_def, types  # noqa: E402


def _run_ops(inputs: list[np.ndarray], graph, layout: str = ""):
    @pipeline_def(batch_size=len(inputs), num_threads=1, device_id=None)
    def pipe():
        x = fn.external_source(
            source=lambda: inputs, batch=True, dtype=types.FLOAT, layout=layout or None
        )
        return graph(x)

    p = pipe()
    p.build()
    outs = p.run()
    return [[np.array(o[i]) for i in range(len(inputs))] for o in outs]


def _recorded_like(path, text: str, seed: int, gated: bool) -> None:
    raw = path.with_suffix(".raw.wav")
    subprocess.run(["espeak-ng", "-s", "150", "-w", str(raw), text], check=True)
    room = path.with_suffix(".room.wav")
    subprocess.run(
        ["sox", str(raw), "-r", "16000", "-b", "16", str(room), "highpass", "90", "reverb", "40"]
        + ["pad", "0.4", "0.6"],
        check=True,
    )
    audio, rate = sf.read(room, dtype="float32")
    rng = np.random.default_rng(seed)
    hum = 0.002 * np.sin(2 * np.pi * 50 * np.arange(len(audio)) / rate)
    noise = np.convolve(rng.standard_normal(len(audio)), np.ones(8) / 8, mode="same") * 0.003
    audio = np.clip(audio + hum + noise, -1, 1)
    if gated:  # digital silence around the take, as a noise gate leaves it: trimmed
        audio = np.concatenate([np.zeros(rate // 2), audio, np.zeros(rate * 7 // 10)])
    sf.write(path, audio, rate, subtype="PCM_16")


def _ids(text: str) -> list[int]:
    """Stand-in token ids (one per letter): the pipeline only carries them."""
    return [ord(c) - ord("a") + 1 for c in text if c.isalpha()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Utterance]:
    root = tmp_path_factory.mktemp("dali_corpus")
    utts = []
    for plan in plan_split("sentences", "dev", 3, seed=11):
        n = synthesize(plan, root)
        path = str(root / plan.relative_audio)
        utts.append(Utterance(plan.utt_id, path, n / 16000, plan.text, _ids(plan.text)))
    for i, text in enumerate(["she sells sea shells by the sea shore", "good morning"]):
        path = root / f"recorded-{i}.flac"
        _recorded_like(path, text, seed=i, gated=i == 1)
        utts.append(Utterance(f"rec-{i}", str(path), sf.info(path).duration, text, _ids(text)))
    return utts


def _cfg(backend: str, **features) -> Config:
    cfg = Config()
    cfg.data.backend = backend
    cfg.data.device = "cpu"
    # DALI: one thread; torch: no worker processes (their start-up dominates tiny tests)
    cfg.data.num_threads = 1 if backend == "dali" else 0
    cfg.eval.batch_size = 3
    cfg.training.batch_size = 2
    cfg.training.seed = 1  # the Trainer's job otherwise
    for key, value in features.items():
        setattr(cfg.features, key, value)
    return cfg


def _by_utt(loader) -> dict[str, np.ndarray]:
    out = {}
    for batch in loader:
        for row, utt_id in enumerate(batch.utt_ids):
            out[utt_id] = batch.feats[row, :, : int(batch.feat_lens[row])].numpy()
            assert torch.all(batch.feats[row, :, int(batch.feat_lens[row]) :] == 0)
    return out


def test_mel_filter_bank_matches_librosa():
    (mel,) = _run_ops(
        [np.eye(257, dtype=np.float32)],
        lambda x: fn.mel_filter_bank(
            x, sample_rate=16000, nfilter=80, normalize=True, mel_formula="slaney", freq_high=8000
        ),
        layout="ft",
    )
    ref = librosa.filters.mel(sr=16000, n_fft=512, n_mels=80)
    np.testing.assert_allclose(mel[0], ref, atol=1e-6)


def test_nonsilent_region_equals_torch_trim():
    rng = np.random.default_rng(0)
    rows = []
    for n, lo, hi in [(20000, 6000, 11000), (9001, 0, 4000), (1800, 200, 900), (30000, 100, 29000)]:
        x = (rng.standard_normal(n) * 1e-4).astype(np.float32)
        x[lo:hi] += rng.standard_normal(hi - lo).astype(np.float32) * 0.2
        rows.append(x)
    begin, length = _run_ops(
        rows,
        lambda x: tuple(fn.nonsilent_region(x, cutoff_db=-60, reset_interval=TRIM_RESET_INTERVAL)),
    )
    lens = torch.tensor([len(r) for r in rows])
    wave = torch.zeros(len(rows), int(lens.max()))
    for i, r in enumerate(rows):
        wave[i, : len(r)] = torch.from_numpy(r)
    trimmed, new_lens = trim_silence(wave, lens, -60.0)
    assert [int(v) for v in length] == new_lens.tolist()
    for i, r in enumerate(rows):
        b = int(begin[i])
        assert torch.equal(
            trimmed[i, : int(new_lens[i])], torch.from_numpy(r[b : b + int(length[i])])
        )


def test_dali_cpu_matches_torch_features(corpus):
    dali_feats = _by_utt(build_loader(_cfg("dali", dither=0.0), corpus, train=False))
    torch_feats = _by_utt(build_loader(_cfg("torch", dither=0.0), corpus, train=False))
    assert sorted(dali_feats) == sorted(u.utt_id for u in corpus)
    for utt in corpus:
        d, t = dali_feats[utt.utt_id], torch_feats[utt.utt_id]
        assert d.shape == t.shape and d.shape[0] == 80
        np.testing.assert_allclose(d, t, atol=1e-3, err_msg=utt.utt_id)
    # the same maths as the one-shot extractor on the decoded file
    samples, _ = read_audio(corpus[-1].audio)
    wave = torch.from_numpy(samples)[None]
    ref, ref_len = FeatureExtractor(_cfg("torch", dither=0.0).features, train=False)(
        wave, torch.tensor([wave.shape[1]])
    )
    np.testing.assert_allclose(torch_feats["rec-1"], ref[0, :, : int(ref_len[0])].numpy())
    # its gated silence was trimmed, so the parity above covers the trim too
    assert torch_feats["rec-1"].shape[1] < 1 + len(samples) // 160 - 50


def test_speed_perturbation_is_seeded_and_in_range(corpus):
    def loader():
        cfg = _cfg("dali", dither=1e-5)
        cfg.training.seed = 1
        return build_loader(cfg, corpus[:4], train=True)

    def lengths(source, epoch: int) -> dict[str, int]:
        source.set_epoch(epoch)
        return {u: int(n) for b in source for u, n in zip(b.utt_ids, b.feat_lens)}

    reused = loader()
    first = lengths(reused, 0)
    assert len(first) == 4
    assert first != lengths(reused, 1)
    assert first == lengths(reused, 0)  # the pipeline restarts cleanly at each epoch
    assert first == lengths(loader(), 0)
    plain = _by_utt(build_loader(_cfg("dali", dither=0.0), corpus[:4], train=False))
    for utt_id, frames in first.items():
        # trimmed length / speed, for speed in [0.85, 1.15] (plus rounding of frames)
        unperturbed = plain[utt_id].shape[1]
        assert unperturbed / 1.15 - 2 <= frames <= unperturbed / 0.85 + 2


def test_evaluation_passes_dither_identically(corpus):
    # Synthesized speech keeps digital silence (corpus[:3] are espeak-ng files, untrimmed
    # edges aside), whose features are dither alone: a pass that dithered differently would
    # score differently (the trainer's per-epoch WER would not match eval.py's).
    loader = build_loader(_cfg("dali", dither=1e-5), corpus[:3], train=False)
    first, second = _by_utt(loader), _by_utt(loader)
    fresh = _by_utt(build_loader(_cfg("dali", dither=1e-5), corpus[:3], train=False))
    undithered = _by_utt(build_loader(_cfg("dali", dither=0.0), corpus[:3], train=False))
    for utt_id, feats in first.items():
        np.testing.assert_array_equal(second[utt_id], feats, err_msg=utt_id)
        np.testing.assert_array_equal(fresh[utt_id], feats, err_msg=utt_id)
    assert any(np.abs(first[u] - undithered[u]).max() > 1e-3 for u in first)  # dither is on


def _first_batch_error(cfg: Config, utts: list[Utterance]) -> BaseException | None:
    """Iterate in a thread with a deadline: a hang fails the test instead of blocking CI."""
    box: list[BaseException] = []

    def run():
        try:
            for _ in build_loader(cfg, utts, train=False):
                pass
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            box.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the pipeline hung on a bad file"
    return box[0] if box else None


def test_missing_and_corrupt_files_are_named(corpus, tmp_path):
    good = corpus[:2]
    missing = Utterance("gone", str(tmp_path / "gone.flac"), 1.0, "gone")
    err = _first_batch_error(_cfg("dali"), [*good, missing])
    assert isinstance(err, AudioFileError) and "gone.flac: audio file not found" in str(err)

    corrupt_path = tmp_path / "corrupt.flac"
    corrupt_path.write_bytes(b"fLaC" + np.random.default_rng(0).bytes(4000))
    corrupt = Utterance("corrupt", str(corrupt_path), 1.0, "corrupt")
    err = _first_batch_error(_cfg("dali"), [*good, corrupt])
    assert isinstance(err, AudioFileError) and "corrupt.flac" in str(err)


def test_skip_bad_drops_a_file_that_cannot_be_read(corpus, tmp_path):
    """Dropped before DALI sees it, the batch one shorter; a file DALI cannot decode still
    stops the run (above), since a fed sample cannot be taken out again."""
    missing = Utterance("gone", str(tmp_path / "gone.flac"), 1.0, "gone")
    cfg = _cfg("dali")
    cfg.data.skip_bad = True
    cfg.eval.batch_size = 4  # one batch
    loader = build_loader(cfg, [*corpus[:3], missing], train=False)
    (batch,) = list(loader)
    assert sorted(batch.utt_ids) == sorted(u.utt_id for u in corpus[:3])
    assert batch.feats.shape[0] == 3 and loader.dropped_utterances == 1


def test_files_read_ahead_keep_their_order_and_a_later_bad_file_is_named(corpus, tmp_path):
    """DALI reads the files on its threads, the next batch's ahead of the one handed out: a
    missing file in the second of two batches still stops the pass with one line naming it
    (DALI asks its source for two batches before it hands out the first), or, skipped, leaves
    every other utterance in the order of the run without it, each with its own bytes."""
    cfg = _cfg("dali", dither=0.0)
    cfg.eval.batch_size = 3
    cfg.data.num_threads = 2
    reference = [i for b in build_loader(cfg, corpus, train=False) for i in b.utt_ids]
    features = _by_utt(build_loader(cfg, corpus, train=False))
    missing = Utterance("gone", str(tmp_path / "gone.flac"), 0.05, "gone")  # the shortest
    with pytest.raises(AudioFileError, match="gone.flac: audio file not found"):
        list(build_loader(cfg, [*corpus, missing], train=False))
    cfg.data.skip_bad = True
    loader = build_loader(cfg, [*corpus, missing], train=False)
    batches = [b.utt_ids for b in loader]
    assert len(batches) == 2 and [i for b in batches for i in b] == reference
    assert loader.dropped_utterances == 1
    for utt_id, feats in _by_utt(loader).items():  # each utterance's own bytes, not a neighbour's
        np.testing.assert_allclose(feats, features[utt_id], atol=1e-5, err_msg=utt_id)


def test_the_prefetch_depth_changes_no_batch(corpus):
    """data.device_prefetch sets how far DALI runs ahead; the batches, their speed draws and
    their dither are the same at every depth, over an epoch boundary."""

    def epochs(prefetch: int) -> list[tuple[list[str], torch.Tensor]]:
        cfg = _cfg("dali")
        cfg.data.device_prefetch = prefetch
        sampler = BucketingSampler([u.duration for u in corpus], 2, 1, 0, 1, seed=1)
        loader = build_loader(cfg, corpus, train=True, sampler=sampler)
        out = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            out += [(b.utt_ids, b.feats) for b in loader]
        assert loader.backend.pipeline.prefetch_queue_depth == prefetch + 1
        return out

    reference = epochs(1)
    assert len(reference) == 4
    for prefetch in (0, 3):
        got = epochs(prefetch)
        assert [ids for ids, _ in got] == [ids for ids, _ in reference]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, reference)), prefetch


@pytest.mark.parametrize(
    "features, where, prefetch",
    [
        ("dali", "cpu", 1),
        ("dali", "cpu", 3),
        ("stage", "cpu", 1),
        ("stage", "cpu", 3),
        pytest.param("stage", "cuda", 1, marks=pytest.mark.gpu),
    ],
)
def test_generator_state_resumes_the_dither_exactly(corpus, features, where, prefetch):
    """DALI's features (data.device cpu): a loader restored from (position, generator state)
    after one batch gives the second batch bit for bit; one restored from the position alone
    dithers differently. However far DALI has run ahead. With the device stage (data.device
    gpu; on a GPU, or on the host), every draw is a function of the batch's seed, and the
    position alone resumes it exactly."""
    cfg = _cfg("dali")
    stage = features == "stage"
    cfg.data.device = "gpu" if stage else "cpu"
    cfg.data.resampling_device = "gpu" if stage else "cpu"
    cfg.data.device_prefetch = prefetch

    def loader():
        sampler = BucketingSampler([u.duration for u in corpus], 2, 1, 0, 1, seed=1)
        return build_loader(cfg, corpus, train=True, sampler=sampler, device=where)

    first = loader()
    first.set_epoch(1)
    batches = iter(first)
    next(batches)
    position = first.state_dict()  # DALI has fetched ahead: the position counts what was taken
    assert position["batches_done"] == 1
    generators = first.generator_state()
    assert bool(generators) != stage
    reference = next(batches)
    assert reference.feats.device.type == where

    resumed = loader()
    resumed.load_state_dict(position)
    resumed.load_generator_state(generators)
    resumed.set_epoch(1)
    again = next(iter(resumed))
    assert again.utt_ids == reference.utt_ids and torch.equal(again.feats, reference.feats)

    control = loader()
    control.load_state_dict(position)
    control.set_epoch(1)
    other = next(iter(control))
    assert other.utt_ids == reference.utt_ids
    assert torch.equal(other.feats, reference.feats) == stage


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_device_stage_on_dali_decoding_gives_the_torch_backends_features(corpus, where):
    """data.device gpu: DALI only decodes (int16 PCM), and the device stage that the torch
    backend ends in computes the features. Undithered, the two backends then give the same
    batches bit for bit, host lengths included: on a GPU (DALI copies its batch there), and
    with the stage on the host."""
    cfg = _cfg("dali", dither=0.0)
    cfg.data.device = "gpu"
    dali_loader = build_loader(cfg, corpus, train=False, device=where)
    assert (dali_loader.stage.stream is None) == (where == "cpu")
    torch_cfg = _cfg("torch", dither=0.0)
    torch_cfg.data.device = "gpu"
    by_torch = list(build_loader(torch_cfg, corpus, train=False, device=where))
    by_dali = list(dali_loader)
    assert len(by_dali) == len(by_torch) == 2
    for d, t in zip(by_dali, by_torch, strict=True):
        assert d.utt_ids == t.utt_ids and d.feats.device.type == where
        assert torch.equal(d.feats, t.feats) and torch.equal(d.feat_lens, t.feat_lens)
        assert torch.equal(d.host_lens[0], t.feat_lens.cpu())
    # against DALI's own operators, as the torch backend's features are
    on_host = _by_utt(build_loader(_cfg("dali", dither=0.0), corpus, train=False))
    for batch in by_dali:
        for row, utt_id in enumerate(batch.utt_ids):
            feats = batch.feats[row, :, : int(batch.feat_lens[row])].cpu().numpy()
            np.testing.assert_allclose(feats, on_host[utt_id], atol=1e-3, err_msg=utt_id)
    spent = dali_loader.time
    assert spent.workers > 0 and spent.queueing > 0


def test_the_device_stage_perturbs_at_the_speeds_drawn_for_each_batch(corpus):
    """Training with the stage resampling (data.resampling_device gpu): DALI decodes at the
    files' rate and the stage resamples each utterance at the speed drawn from its batch's
    seed; queued ahead or not, the batches are the same."""
    from rnnt.data.features import draw_speeds
    from rnnt.seeds import derive_seed

    def epoch(prefetch: int) -> list:
        cfg = _cfg("dali", dither=1e-5)
        cfg.data.device = cfg.data.resampling_device = "gpu"
        cfg.data.device_prefetch = prefetch
        sampler = BucketingSampler([u.duration for u in corpus], 2, 1, 0, 1, seed=1)
        loader = build_loader(cfg, corpus, train=True, sampler=sampler)
        loader.set_epoch(2)
        return list(loader)

    batches = epoch(1)
    assert len(batches) == 2
    for prefetch in (0, 2):
        for a, b in zip(epoch(prefetch), batches, strict=True):
            assert a.utt_ids == b.utt_ids and torch.equal(a.feats, b.feats)
    cfg = _cfg("dali")
    plain = _by_utt(build_loader(_cfg("dali", dither=0.0), corpus, train=False))
    for batch_no, batch in enumerate(batches):
        seed = derive_seed(1, 0, 2, batch_no)  # (training.seed, rank, epoch, batch)
        speeds = draw_speeds(cfg.features, len(batch), torch.Generator().manual_seed(seed))
        for row, utt_id in enumerate(batch.utt_ids):
            # the trimmed length at this row's speed, to the rounding of frames
            expected = plain[utt_id].shape[1] / float(speeds[row])
            assert abs(int(batch.feat_lens[row]) - expected) <= 2, (utt_id, float(speeds[row]))


@pytest.mark.gpu
@pytest.mark.parametrize("resampling_device", ["cpu", "gpu"])
def test_dali_gpu_matches_cpu(corpus, resampling_device):
    cfg = _cfg("dali", dither=0.0)
    cpu = _by_utt(build_loader(cfg, corpus, train=False))
    cfg.data.device = "gpu"
    cfg.data.resampling_device = resampling_device
    gpu_loader = build_loader(cfg, corpus, train=False, device="cuda")
    batch = next(iter(gpu_loader))
    assert batch.feats.is_cuda
    gpu = {}
    for batch in gpu_loader:
        for row, utt_id in enumerate(batch.utt_ids):
            gpu[utt_id] = batch.feats[row, :, : int(batch.feat_lens[row])].cpu().numpy()
    for utt_id, ref in cpu.items():
        assert gpu[utt_id].shape == ref.shape
        assert math.isfinite(float(np.abs(gpu[utt_id]).max()))
        np.testing.assert_allclose(gpu[utt_id], ref, atol=1e-3, err_msg=utt_id)


def test_dali_reads_a_file_whose_name_is_not_ascii(corpus, tmp_path):
    """DALI reads the files from the paths it is handed as bytes: a name outside ASCII gives
    the same features as the same file under its first name."""
    import shutil

    source = corpus[0]
    renamed = tmp_path / f"voix-é-{source.utt_id}.wav"
    shutil.copy(source.audio, renamed)
    cfg = _cfg("dali", dither=0.0)
    cfg.eval.batch_size = 1
    original = _by_utt(build_loader(cfg, [source], train=False))[source.utt_id]
    moved = Utterance(
        source.utt_id, str(renamed), source.duration, source.transcript, source.tokens
    )
    again = _by_utt(build_loader(cfg, [moved], train=False))[source.utt_id]
    np.testing.assert_array_equal(again, original)
