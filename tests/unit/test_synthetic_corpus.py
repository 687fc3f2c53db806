"""Synthetic espeak-ng corpora: layout, transcripts, audio format, determinism, resumption.

Corpora here are a handful of utterances built in tmp_path with the real espeak-ng.
"""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf

from rnnt.data.text import ALPHABET
from rnnt.prep import synthetic_corpus as sc

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")

FLAC_NAME = re.compile(r"^(\d+)-(\d+)-(\d{4})\.flac$")


def corpus_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != sc.STAMP_NAME
    }


def read_transcripts(split_dir: Path) -> dict[str, str]:
    out = {}
    for trans in split_dir.rglob("*.trans.txt"):
        for line in trans.read_text().splitlines():
            utt_id, text = line.split(" ", 1)
            out[utt_id] = text
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    sc.build_corpus(root, "digits", train=10, dev=4, seed=7, workers=2, progress=False)
    return root


def test_layout_is_librispeech(digits):
    assert sorted(p.name for p in digits.iterdir()) == ["dev", sc.STAMP_NAME, "train"]
    for split, size in (("train", 10), ("dev", 4)):
        flacs = sorted((digits / split).rglob("*.flac"))
        assert len(flacs) == size
        for flac in flacs:
            speaker, chapter = flac.parts[-3], flac.parts[-2]
            match = FLAC_NAME.match(flac.name)
            assert match and match.group(1, 2) == (speaker, chapter), flac
            assert flac.parent.parent.parent == digits / split
        chapters = {f.parent for f in flacs}
        for chapter_dir in chapters:
            trans = chapter_dir / f"{chapter_dir.parent.name}-{chapter_dir.name}.trans.txt"
            ids = [line.split(" ", 1)[0] for line in trans.read_text().splitlines()]
            assert ids == sorted(f.stem for f in chapter_dir.glob("*.flac"))
    train_ids = set(read_transcripts(digits / "train"))
    assert not train_ids & set(read_transcripts(digits / "dev"))
    stamp = json.loads((digits / sc.STAMP_NAME).read_text())
    assert stamp["complete"] and stamp["parameters"]["sizes"] == {"train": 10, "dev": 4}


def test_transcripts_are_the_spoken_text(digits):
    for split, size in (("train", 10), ("dev", 4)):
        plans = sc.plan_split("digits", split, size, seed=7)
        written = read_transcripts(digits / split)
        assert written == {p.utt_id: p.text.upper() for p in plans}
        for plan in plans:
            words = plan.text.split()
            assert 1 <= len(words) <= 7 and set(words) <= set(sc.DIGIT_WORDS)
            # Speech length tracks the number of words said: about 0.4 s a digit.
            info = sf.info(str(digits / plan.relative_audio))
            speech = info.frames / info.samplerate - plan.lead_silence - plan.trail_silence
            assert 0.2 < speech / len(words) < 0.9, (plan.utt_id, speech, words)


def test_audio_is_16khz_mono_pcm16_flac_with_jittered_silence(digits):
    for flac in digits.rglob("*.flac"):
        info = sf.info(str(flac))
        assert (info.samplerate, info.channels, info.format, info.subtype) == (
            16000,
            1,
            "FLAC",
            "PCM_16",
        )
    plan = sc.plan_split("digits", "dev", 4, seed=7)[0]
    audio, _ = sf.read(str(digits / plan.relative_audio), dtype="float32")
    lead = audio[: int(plan.lead_silence * 16000) - 160]
    speech_rms = np.sqrt(np.mean(audio**2))
    noise_rms = np.sqrt(np.mean(lead**2))
    assert 0 < noise_rms < speech_rms / 10 ** (25 / 20)  # noise present, well below the speech
    assert np.abs(audio).max() == pytest.approx(plan.peak, abs=0.05)


def test_same_seed_same_bytes_regardless_of_workers(digits, tmp_path):
    sc.build_corpus(tmp_path / "a", "digits", train=10, dev=4, seed=7, workers=1, progress=False)
    assert corpus_files(tmp_path / "a") == corpus_files(digits)
    sc.build_corpus(tmp_path / "b", "digits", train=6, dev=4, seed=8, workers=1, progress=False)
    assert read_transcripts(tmp_path / "b" / "train") != read_transcripts(digits / "train")


def test_rerun_skips_resumes_and_refuses_other_parameters(tmp_path):
    root = tmp_path / "c"
    first = sc.build_corpus(root, "digits", train=3, dev=2, seed=1, workers=1, progress=False)
    assert not first.skipped and set(first.audio_seconds) == {"train", "dev"}
    before = corpus_files(root)
    again = sc.build_corpus(root, "digits", train=3, dev=2, seed=1, workers=1, progress=False)
    assert again.skipped and again.audio_seconds == first.audio_seconds

    # An interrupted run (stamp not complete, a file missing) is finished, not restarted.
    stamp = json.loads((root / sc.STAMP_NAME).read_text())
    (root / sc.STAMP_NAME).write_text(json.dumps({**stamp, "complete": False}))
    victim = next(root.rglob("*.flac"))
    victim.unlink()
    resumed = sc.build_corpus(root, "digits", train=3, dev=2, seed=1, workers=1, progress=False)
    assert not resumed.skipped and corpus_files(root) == before
    assert resumed.audio_seconds == first.audio_seconds

    with pytest.raises(sc.CorpusError, match=r"synthetic_corpus\.json.*--force"):
        sc.build_corpus(root, "digits", train=4, dev=2, seed=1, workers=1, progress=False)
    rebuilt = sc.build_corpus(
        root, "digits", train=4, dev=2, seed=1, workers=1, force=True, progress=False
    )
    assert not rebuilt.skipped and len(list((root / "train").rglob("*.flac"))) == 4


def test_existing_splits_without_stamp_are_not_overwritten(tmp_path):
    (tmp_path / "train" / "1" / "2").mkdir(parents=True)
    (tmp_path / "train" / "1" / "2" / "1-2.trans.txt").write_text("1-2-0000 HELLO\n")
    with pytest.raises(sc.CorpusError, match="train already exist"):
        sc.build_corpus(tmp_path, "digits", train=1, dev=1, workers=1, progress=False)


def test_bad_arguments_fail_before_writing(tmp_path):
    with pytest.raises(sc.CorpusError, match="unknown corpus kind 'vowels'"):
        sc.build_corpus(tmp_path / "v", "vowels", train=1, dev=1, workers=1, progress=False)
    with pytest.raises(sc.CorpusError, match="split dev: size must be >= 0"):
        sc.build_corpus(tmp_path / "v", "digits", train=1, dev=-1, workers=1, progress=False)
    assert not (tmp_path / "v").exists()


def test_voices_differ_female_variants_are_higher():
    """Each speaker is a distinct voice: same words, same settings, other variant -> other
    audio; the f-variants' fundamental frequency (librosa's YIN) is well above the m-variants'."""
    assert len({s.voice for s in sc.speakers(1)}) == len(sc.VOICES) * len(sc.VARIANTS)
    base = sc.plan_split("digits", "train", 1, seed=1)[0]

    def median_f0(voice: str) -> float:
        speaker = dataclasses.replace(base.speaker, voice=voice)
        plan = dataclasses.replace(base, speaker=speaker, text="one two three", pitch=50, speed=160)
        audio = sc.render(plan)
        f0 = librosa.yin(audio, fmin=60, fmax=400, sr=16000)
        loud = librosa.feature.rms(y=audio)[0] > 0.05
        n = min(len(f0), len(loud))
        return float(np.median(f0[:n][loud[:n]]))

    for voice in ("en-us", "en-gb-x-rp"):
        assert median_f0(f"{voice}+f2") > 1.4 * median_f0(f"{voice}+m2")


def test_sentences_corpus_and_vocabulary(tmp_path):
    gen = sc.SentenceGenerator()
    vocab = gen.vocabulary()
    assert len(vocab) >= 2500  # a few thousand distinct words
    rng = np.random.default_rng(0)
    sentences = [gen.sentence(rng) for _ in range(6000)]
    used = {w for s in sentences for w in s.split()}
    assert used <= vocab and len(used) >= 0.9 * len(vocab)
    assert all(4 <= len(s.split()) <= 15 for s in sentences)
    assert set("".join(sentences)) <= ALPHABET
    again = np.random.default_rng(0)
    assert [gen.sentence(again) for _ in range(50)] == sentences[:50]

    sc.build_corpus(tmp_path, "sentences", train=2, dev=1, seed=3, workers=1, progress=False)
    written = read_transcripts(tmp_path / "dev")
    (plan,) = sc.plan_split("sentences", "dev", 1, seed=3)
    assert written == {plan.utt_id: plan.text.upper()}


@pytest.mark.parametrize(
    "noun, plural",
    [("box", "boxes"), ("baby", "babies"), ("key", "keys"), ("wolf", "wolves"), ("bus", "buses")],
)
def test_plural(noun, plural):
    assert sc.plural(noun) == plural


@pytest.mark.parametrize(
    "verb, third",
    [("carry", "carries"), ("play", "plays"), ("watch", "watches"), ("tiptoe", "tiptoes")],
)
def test_third_person(verb, third):
    assert sc.third_person(verb) == third


def test_articles():
    assert [sc.indefinite_article(w) for w in ("apple", "uniform", "hour", "dog")] == [
        "an",
        "a",
        "an",
        "a",
    ]


def test_cli_reports_summary_and_errors(tmp_path, repo_root):
    script = repo_root / "scripts" / "make_synthetic_corpus.py"
    cmd = [sys.executable, str(script), "digits", str(tmp_path), "--train", "1", "--dev", "1"]
    done = subprocess.run(cmd + ["--workers", "1", "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["utterances"] == {"train": 1, "dev": 1}
    other = subprocess.run(cmd[:-1] + ["2"], capture_output=True, text=True)
    assert other.returncode == 2 and "--force" in other.stderr
    assert other.stderr.count("\n") == 1 and other.stderr.startswith("error: ")


def test_round_trip_through_manifest_and_tokenizer(digits, tmp_path, repo_root):
    """corpus -> manifest builder -> train_tokenizer.py on the train manifest -> ids -> text."""
    from rnnt.data.manifest import read_manifest
    from rnnt.data.tokenizer import Tokenizer
    from rnnt.prep.manifests import build_manifest, write_manifest

    # Ten train utterances say every digit, so no dev transcript can need <unk>.
    train, report = build_manifest(digits, ["train"], strict=True)
    assert report.problems == [] and len(train) == 10
    write_manifest(tmp_path / "train.jsonl", train)
    script = repo_root / "scripts" / "train_tokenizer.py"
    prefix = tmp_path / "digits18"
    cmd = [sys.executable, str(script), "--manifests", str(tmp_path / "train.jsonl")]
    done = subprocess.run(
        cmd + ["--vocab-size", "18", "--output-prefix", str(prefix)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    tokenizer = Tokenizer(f"{prefix}.model")

    dev, _ = build_manifest(digits, ["dev"], tokenizer=tokenizer, strict=True)
    write_manifest(tmp_path / "dev.jsonl", dev)
    back = read_manifest(tmp_path / "dev.jsonl", digits)
    spoken = {p.utt_id: p for p in sc.plan_split("digits", "dev", 4, seed=7)}
    assert sorted(u.utt_id for u in back) == sorted(spoken)
    for utt in back:
        plan = spoken[utt.utt_id]
        assert tokenizer.decode(utt.tokens) == utt.transcript == plan.text
        assert Path(utt.audio) == digits / plan.relative_audio
        assert utt.duration == pytest.approx(sf.info(utt.audio).duration, abs=1e-3)
    stamp = json.loads((digits / sc.STAMP_NAME).read_text())
    assert sum(u.duration for u in back) == pytest.approx(stamp["audio_seconds"]["dev"], abs=0.01)


def test_held_out_speakers_speak_only_in_dev():
    train = sc.plan_split("digits", "train", 3000, seed=4, held_out_speakers=12)
    dev = sc.plan_split("digits", "dev", 500, seed=4, held_out_speakers=12)
    train_voices = {p.speaker.speaker_id for p in train}
    dev_voices = {p.speaker.speaker_id for p in dev}
    assert len(dev_voices) == 12 and len(train_voices) == len(sc.speakers(4)) - 12
    assert not train_voices & dev_voices
    shared = sc.plan_split("digits", "dev", 500, seed=4)  # the default: dev shares the voices
    assert {p.speaker.speaker_id for p in shared} & train_voices
    with pytest.raises(sc.CorpusError, match="held_out_speakers"):
        sc.plan_split("digits", "dev", 1, seed=4, held_out_speakers=84)


def test_librispeech_durations_give_utterances_as_long_as_librispeech():
    """Sentences joined to durations drawn from the train-clean-5 table: rendered, they last
    about as long (espeak-ng's pace is calibrated), and the words follow the drawn durations."""
    plans = sc.plan_split("sentences", "train", 24, seed=6, durations="librispeech")
    seconds = np.array([sc.render(p).shape[0] / sc.SAMPLE_RATE for p in plans])
    table = sc.librispeech_durations("train")
    assert abs(seconds.mean() - table.mean()) < 0.2 * table.mean()
    assert seconds.max() < table.max() * 1.3 and seconds.min() > 1.0
    paced = np.array([len(p.text.split()) * 60 / p.speaker.speed for p in plans])
    assert np.corrcoef(paced, seconds)[0, 1] > 0.9  # the text was cut to the duration
    vocabulary = sc.SentenceGenerator().vocabulary()
    assert all(set(p.text.split()) <= vocabulary for p in plans)
    with pytest.raises(sc.CorpusError, match="needs the sentences kind"):
        sc.plan_split("digits", "train", 1, seed=6, durations="librispeech")


def test_the_options_enter_the_stamp_only_when_used(tmp_path):
    plain = sc.build_corpus(
        tmp_path / "a", "digits", train=2, dev=1, seed=2, workers=1, progress=False
    )
    stamp = json.loads((Path(plain.root) / sc.STAMP_NAME).read_text())["parameters"]
    assert set(stamp) == {"kind", "seed", "sizes", "format", "espeak_ng"}  # as before them
    held = sc.build_corpus(
        tmp_path / "b",
        "digits",
        train=2,
        dev=1,
        seed=2,
        workers=1,
        progress=False,
        held_out_speakers=3,
    )
    stamp = json.loads((Path(held.root) / sc.STAMP_NAME).read_text())["parameters"]
    assert stamp["held_out_speakers"] == 3 and "durations" not in stamp
