"""Spoken corpora synthesized with espeak-ng, written in the LibriSpeech layout.

Two tasks: `digits` (1 to 7 spoken digits, learnable to near-zero WER by a tiny model on CPU)
and `sentences` (grammatical English sentences over a few thousand words). The output is what
the real pipeline reads, so every later stage runs on real audio files:

    <out>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt:04d>.flac   (16 kHz mono, 16-bit)
    <out>/<split>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt        (UTTID TEXT IN CAPS)
    <out>/synthetic_corpus.json                                            (parameters stamp)

A speaker is an espeak-ng voice and variant with its own base pitch and speed; train and dev
share the speakers (dev stays inside the training distribution) but never a (speaker, chapter)
pair, so utterance ids are unique across splits; `held_out_speakers` reserves some speakers for
dev alone, to measure how a model does on voices it never heard. `durations="librispeech"`
makes `sentences` utterances as long as LibriSpeech's: each joins sentences until it would last
about a duration drawn from the shipped LibriSpeech length tables (train-clean-5 for train,
dev-clean for dev), so the long-sequence paths of training (graph buckets, the LSTM kernels, the
packed lattice) get real work. Every utterance's text and acoustic settings
come from a generator seeded by (seed, split, index) alone, so the corpus does not depend on the
number of workers or the order they finish in.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from tqdm import tqdm

from rnnt.errors import UserError
from rnnt.prep import wordlist

SAMPLE_RATE = 16000
ESPEAK_RATE = 22050  # espeak-ng's output rate
KINDS = ("digits", "sentences")
DURATIONS = ("natural", "librispeech")
SPLIT_CODES = {"train": 1, "dev": 2}  # part of each utterance's seed and of its chapter id
DEFAULT_DEV_SIZE = 2703  # dev-clean's size: eval_samples of a compliant MLPerf log
STAMP_NAME = "synthetic_corpus.json"
# Bump when a change alters the audio or text produced for the same parameters, so that an old
# corpus is not mistaken for a current one.
FORMAT_VERSION = 1

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MIN_DIGITS, MAX_DIGITS = 1, 7
MIN_SENTENCE_WORDS, MAX_SENTENCE_WORDS = 4, 15

# "en-gb" ignores "+variant" in espeak-ng 1.51 ("en" does not), and "en-us-nyc" sounds exactly
# like "en-us", so neither is listed: every (voice, variant) pair below is a different sound.
VOICES = (
    "en",
    "en-us",
    "en-gb-x-rp",
    "en-gb-scotland",
    "en-029",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
)
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
PITCH_RANGE = (30, 70)  # espeak-ng -p, per speaker
SPEED_RANGE = (130, 200)  # espeak-ng -s (words per minute), per speaker
PITCH_JITTER = 5  # per utterance, around the speaker's base
SPEED_JITTER = 10
SILENCE_RANGE = (0.05, 0.35)  # seconds added before and after the speech
# espeak-ng speaks these sentences a little faster than its -s words per minute: the ratio of
# its rate to -s, measured over 40 utterances of the librispeech durations (espeak-ng 1.51)
ESPEAK_PACE = 1.056
PEAK_RANGE = (0.3, 0.9)  # peak amplitude after scaling (recording level)
SNR_RANGE_DB = (30.0, 50.0)  # white noise below the speech RMS: not clean, still easy
FIRST_SPEAKER_ID = 100
UTTERANCES_PER_CHAPTER = 100
MAX_CHAPTERS_PER_SPEAKER = 1000  # chapter ids are split_code * 1000 + chapter number


class CorpusError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Speaker:
    speaker_id: int
    voice: str  # espeak-ng -v argument, "voice+variant"
    pitch: int
    speed: int


@dataclass(frozen=True)
class UtterancePlan:
    """Everything needed to synthesize one utterance, fixed before any audio is made."""

    split: str
    index: int  # position in the split, the seed of everything below
    speaker: Speaker
    chapter_id: int
    utt_num: int
    text: str  # lower case; spoken exactly as written
    pitch: int
    speed: int
    lead_silence: float
    trail_silence: float
    peak: float
    snr_db: float
    noise_seed: int

    @property
    def utt_id(self) -> str:
        return f"{self.speaker.speaker_id}-{self.chapter_id}-{self.utt_num:04d}"

    @property
    def relative_dir(self) -> Path:
        return Path(self.split) / str(self.speaker.speaker_id) / str(self.chapter_id)

    @property
    def relative_audio(self) -> Path:
        return self.relative_dir / f"{self.utt_id}.flac"


# ---------------------------------------------------------------------------------------------
# Text


def digits_text(rng: np.random.Generator) -> str:
    n = int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
    return " ".join(DIGIT_WORDS[int(d)] for d in rng.integers(0, 10, size=n))


def plural(noun: str) -> str:
    if noun in wordlist.IRREGULAR_PLURALS:
        return wordlist.IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def third_person(verb: str) -> str:
    """Present tense after he/she/it: spelling rules (every listed verb follows them)."""
    if verb.endswith(("s", "x", "z", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def indefinite_article(word: str) -> str:
    # By sound, not letter: "a uniform", "an hour".
    if word.startswith(("uni", "use", "eu")) or word == "one":
        return "a"
    if word.startswith(("hour", "honest", "honor")):
        return "an"
    return "an" if word[0] in "aeiou" else "a"


class SentenceGenerator:
    """A small English grammar: clauses of subject, verb, object, place and manner, joined
    into simple, compound and question sentences of 4 to 15 words, past or present tense."""

    _SINGULAR_DETERMINERS = (
        "the",
        "a",
        "this",
        "that",
        "my",
        "his",
        "her",
        "our",
        "their",
        "every",
    )
    _PLURAL_DETERMINERS = ("the", "these", "those", "my", "his", "her", "our", "their", "some")
    _CONJUNCTIONS = ("and", "but", "while", "because", "so", "although", "until", "before", "after")
    _INTENSIFIERS = ("very", "quite", "rather", "too", "so")

    def __init__(self) -> None:
        self.nouns = wordlist.words(wordlist.NOUNS)
        self.adjectives = wordlist.words(wordlist.ADJECTIVES)
        self.adverbs = wordlist.words(wordlist.ADVERBS)
        self.names = wordlist.words(wordlist.NAMES)
        self.prepositions = wordlist.words(wordlist.PREPOSITIONS)
        self.counts = wordlist.words(wordlist.COUNT_WORDS)
        self.transitive = wordlist.verb_pairs(wordlist.TRANSITIVE_VERBS)
        self.intransitive = wordlist.verb_pairs(wordlist.INTRANSITIVE_VERBS)

    def vocabulary(self) -> frozenset[str]:
        """Every word the grammar can produce."""
        vocab: set[str] = set()
        vocab.update(self.nouns, (plural(n) for n in self.nouns))
        vocab.update(self.adjectives, self.adverbs, self.names, self.prepositions, self.counts)
        for base, past in self.transitive + self.intransitive:
            vocab.update((base, past, third_person(base)))
        vocab.update(self._SINGULAR_DETERMINERS, self._PLURAL_DETERMINERS, self._CONJUNCTIONS)
        vocab.update(self._INTENSIFIERS)
        vocab.update(("a", "an", "did", "do", "does", "is", "are", "was", "were", "not", "there"))
        return frozenset(vocab)

    def sentence(self, rng: np.random.Generator) -> str:
        while True:
            words = self._sentence(rng)
            if MIN_SENTENCE_WORDS <= len(words) <= MAX_SENTENCE_WORDS:
                return " ".join(words)

    # -- grammar -------------------------------------------------------------------------------

    @staticmethod
    def _pick(rng: np.random.Generator, items: Sequence):
        return items[int(rng.integers(len(items)))]

    def _noun_phrase(self, rng: np.random.Generator) -> tuple[list[str], bool]:
        """Words and whether the phrase is plural."""
        form = rng.random()
        if form < 0.15:
            return [self._pick(rng, self.names)], False
        adjectives = [self._pick(rng, self.adjectives) for _ in range(int(rng.integers(0, 3)))]
        noun = self._pick(rng, self.nouns)
        if form < 0.6:
            det = self._pick(rng, self._SINGULAR_DETERMINERS)
            if det == "a":
                det = indefinite_article((adjectives or [noun])[0])
            return [det, *adjectives, noun], False
        if form < 0.8:
            det = self._pick(rng, self.counts)
        else:
            det = self._pick(rng, self._PLURAL_DETERMINERS)
        return [det, *adjectives, plural(noun)], True

    @staticmethod
    def _verb(pair: tuple[str, str], tense: str, plural_subject: bool) -> str:
        base, past = pair
        if tense == "past":
            return past
        return base if plural_subject else third_person(base)

    def _clause(self, rng: np.random.Generator, tense: str) -> list[str]:
        subject, is_plural = self._noun_phrase(rng)
        words = list(subject)
        if rng.random() < 0.6:
            words.append(self._verb(self._pick(rng, self.transitive), tense, is_plural))
            words += self._noun_phrase(rng)[0]
        else:
            words.append(self._verb(self._pick(rng, self.intransitive), tense, is_plural))
        if rng.random() < 0.5:
            words.append(self._pick(rng, self.prepositions))
            words += self._noun_phrase(rng)[0]
        if rng.random() < 0.3:
            words.append(self._pick(rng, self.adverbs))
        return words

    def _description(self, rng: np.random.Generator, tense: str) -> list[str]:
        subject, is_plural = self._noun_phrase(rng)
        verb = {("past", False): "was", ("past", True): "were"}.get((tense, is_plural))
        verb = verb or ("are" if is_plural else "is")
        words = [*subject, verb]
        if rng.random() < 0.2:
            words.append("not")
        if rng.random() < 0.4:
            words.append(self._pick(rng, self._INTENSIFIERS))
        return words + [self._pick(rng, self.adjectives)]

    def _question(self, rng: np.random.Generator, tense: str) -> list[str]:
        subject, is_plural = self._noun_phrase(rng)
        aux = "did" if tense == "past" else ("do" if is_plural else "does")
        base = self._pick(rng, self.transitive)[0]
        words = [aux, *subject, base, *self._noun_phrase(rng)[0]]
        if rng.random() < 0.4:
            words += [self._pick(rng, self.prepositions), *self._noun_phrase(rng)[0]]
        return words

    def _existential(self, rng: np.random.Generator, tense: str) -> list[str]:
        phrase, is_plural = self._noun_phrase(rng)
        verb = (
            ("were" if is_plural else "was") if tense == "past" else ("are" if is_plural else "is")
        )
        place = [self._pick(rng, self.prepositions), *self._noun_phrase(rng)[0]]
        return ["there", verb, *phrase, *place]

    def _sentence(self, rng: np.random.Generator) -> list[str]:
        tense = "past" if rng.random() < 0.6 else "present"
        form = rng.random()
        if form < 0.45:
            return self._clause(rng, tense)
        if form < 0.65:
            conjunction = self._pick(rng, self._CONJUNCTIONS)
            return [*self._clause(rng, tense), conjunction, *self._clause(rng, tense)]
        if form < 0.8:
            return self._description(rng, tense)
        if form < 0.9:
            return self._question(rng, tense)
        return self._existential(rng, tense)


# ---------------------------------------------------------------------------------------------
# Plan


def speakers(seed: int) -> list[Speaker]:
    """Every voice x variant, each with a base pitch and speed drawn from `seed`."""
    rng = np.random.default_rng([seed, 0])
    out = []
    for voice in VOICES:
        for variant in VARIANTS:
            out.append(
                Speaker(
                    speaker_id=FIRST_SPEAKER_ID + len(out),
                    voice=f"{voice}+{variant}",
                    pitch=int(rng.integers(PITCH_RANGE[0], PITCH_RANGE[1] + 1)),
                    speed=int(rng.integers(SPEED_RANGE[0], SPEED_RANGE[1] + 1)),
                )
            )
    return out


def split_speakers(seed: int, split: str, held_out: int) -> list[Speaker]:
    """The speakers of `split`: all of them, or with `held_out` > 0 a fixed random set of that
    many for dev alone and the others for train."""
    cast = speakers(seed)
    if not 0 <= held_out < len(cast):
        raise CorpusError(f"held_out_speakers must be in [0, {len(cast)}), got {held_out}")
    if held_out == 0:
        return cast
    order = np.random.default_rng([seed, 1]).permutation(len(cast))
    dev = {int(i) for i in order[:held_out]}
    return [s for i, s in enumerate(cast) if (i in dev) == (split == "dev")]


def librispeech_durations(split: str) -> np.ndarray:
    """Durations (seconds) of the shipped LibriSpeech table for `split`."""
    from rnnt.config import LENGTHS_DIR
    from rnnt.data.synthetic import read_lengths_table

    name = "train-clean-5" if split == "train" else "dev-clean"
    return read_lengths_table(LENGTHS_DIR / f"librispeech_{name}_lengths.tsv").durations


def long_text(
    sentences: SentenceGenerator, rng: np.random.Generator, seconds: float, wpm: int
) -> str:
    """Sentences joined, and cut, to the words that last about `seconds` at `wpm` words per
    minute, less the silence `render` adds around them."""
    speech = seconds - sum(SILENCE_RANGE)  # the mean of the lead and trail silences together
    target = max(MIN_SENTENCE_WORDS, round(speech * wpm / 60 * ESPEAK_PACE))
    words: list[str] = []
    while len(words) < target:
        words += sentences.sentence(rng).split()
    return " ".join(words[:target])


def plan_split(
    kind: str,
    split: str,
    size: int,
    seed: int,
    durations: str = "natural",
    held_out_speakers: int = 0,
) -> list[UtterancePlan]:
    """The `size` utterances of one split, in index order.

    durations: "natural" (a sentence or a few digits each) or "librispeech" (sentences only:
    joined to a LibriSpeech duration). held_out_speakers: see `split_speakers`.
    """
    if kind not in KINDS:
        raise CorpusError(f"unknown corpus kind {kind!r}; expected one of {KINDS}")
    if split not in SPLIT_CODES:
        raise CorpusError(f"unknown split {split!r}; expected one of {tuple(SPLIT_CODES)}")
    if size < 0:
        raise CorpusError(f"split {split}: size must be >= 0, got {size}")
    if durations not in DURATIONS:
        raise CorpusError(f"unknown durations {durations!r}; expected one of {DURATIONS}")
    if durations == "librispeech" and kind != "sentences":
        raise CorpusError("durations 'librispeech' needs the sentences kind")
    cast = split_speakers(seed, split, held_out_speakers)
    sentences = SentenceGenerator() if kind == "sentences" else None
    table = librispeech_durations(split) if durations == "librispeech" else None
    drafts = []
    for index in range(size):
        rng = np.random.default_rng([seed, SPLIT_CODES[split], index])
        speaker = cast[int(rng.integers(len(cast)))]
        if table is not None:  # at the speaker's pace (the jitter below is drawn later)
            seconds = float(table[int(rng.integers(len(table)))])
            text = long_text(sentences, rng, seconds, speaker.speed)
        else:
            text = sentences.sentence(rng) if sentences else digits_text(rng)
        drafts.append(
            dict(
                split=split,
                index=index,
                speaker=speaker,
                text=text,
                pitch=speaker.pitch + int(rng.integers(-PITCH_JITTER, PITCH_JITTER + 1)),
                speed=speaker.speed + int(rng.integers(-SPEED_JITTER, SPEED_JITTER + 1)),
                lead_silence=float(rng.uniform(*SILENCE_RANGE)),
                trail_silence=float(rng.uniform(*SILENCE_RANGE)),
                peak=float(rng.uniform(*PEAK_RANGE)),
                snr_db=float(rng.uniform(*SNR_RANGE_DB)),
                noise_seed=int(rng.integers(2**62)),
            )
        )
    # Chapters: each speaker's utterances in index order, cut into chapters of fixed size.
    taken: dict[int, int] = defaultdict(int)
    plans = []
    for draft in drafts:
        position = taken[draft["speaker"].speaker_id]
        taken[draft["speaker"].speaker_id] += 1
        chapter, utt_num = divmod(position, UTTERANCES_PER_CHAPTER)
        if chapter >= MAX_CHAPTERS_PER_SPEAKER:
            raise CorpusError(
                f"split {split}: {size} utterances exceed {MAX_CHAPTERS_PER_SPEAKER} chapters "
                f"of {UTTERANCES_PER_CHAPTER} per speaker"
            )
        chapter_id = SPLIT_CODES[split] * MAX_CHAPTERS_PER_SPEAKER + chapter
        plans.append(UtterancePlan(chapter_id=chapter_id, utt_num=utt_num, **draft))
    return plans


# ---------------------------------------------------------------------------------------------
# Audio


def espeak_ng_version() -> str:
    try:
        out = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True, check=True)
    except FileNotFoundError:
        raise CorpusError(
            "espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)"
        ) from None
    return out.stdout.split("Data at")[0].strip()


def render(plan: UtterancePlan) -> np.ndarray:
    """The utterance's 16 kHz float32 waveform: speech, silence padding, level and noise."""
    cmd = ["espeak-ng", "-v", plan.speaker.voice, "-s", str(plan.speed), "-p", str(plan.pitch)]
    cmd += ["--stdout", plan.text]
    result = subprocess.run(cmd, capture_output=True)
    if result.returncode != 0 or len(result.stdout) <= 44:
        raise CorpusError(
            f"utterance {plan.utt_id}: {' '.join(cmd)!r} failed (exit {result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    speech, rate = sf.read(io.BytesIO(result.stdout), dtype="float32")
    if rate != ESPEAK_RATE or speech.ndim != 1:
        raise CorpusError(f"utterance {plan.utt_id}: espeak-ng gave {rate} Hz, {speech.shape}")
    speech = soxr.resample(speech, ESPEAK_RATE, SAMPLE_RATE, quality="HQ")
    speech *= plan.peak / max(float(np.abs(speech).max()), 1e-6)
    lead = np.zeros(round(plan.lead_silence * SAMPLE_RATE), np.float32)
    trail = np.zeros(round(plan.trail_silence * SAMPLE_RATE), np.float32)
    audio = np.concatenate([lead, speech.astype(np.float32), trail])
    rms = float(np.sqrt(np.mean(speech.astype(np.float64) ** 2)))
    noise = np.random.default_rng(plan.noise_seed).standard_normal(audio.shape[0])
    audio += (noise * rms * 10 ** (-plan.snr_db / 20)).astype(np.float32)
    return np.clip(audio, -1.0, 32767 / 32768)


def synthesize(plan: UtterancePlan, root: Path) -> int:
    """Write the utterance's FLAC under `root` (atomically); returns its number of samples."""
    path = root / plan.relative_audio
    audio = render(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    sf.write(tmp, audio, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
    os.replace(tmp, path)
    return audio.shape[0]


def _synthesize_job(job: tuple[UtterancePlan, Path]) -> int:
    return synthesize(*job)


def write_transcripts(plans: Sequence[UtterancePlan], root: Path) -> None:
    chapters: dict[Path, list[UtterancePlan]] = defaultdict(list)
    for plan in plans:
        chapters[plan.relative_dir].append(plan)
    for rel_dir, members in chapters.items():
        speaker_id, chapter_id = rel_dir.parts[-2:]
        lines = [f"{p.utt_id} {p.text.upper()}\n" for p in sorted(members, key=lambda p: p.utt_id)]
        (root / rel_dir).mkdir(parents=True, exist_ok=True)
        (root / rel_dir / f"{speaker_id}-{chapter_id}.trans.txt").write_text("".join(lines))


# ---------------------------------------------------------------------------------------------
# Corpus


@dataclass
class CorpusSummary:
    root: str
    kind: str
    seed: int
    utterances: dict[str, int]
    audio_seconds: dict[str, float]
    skipped: bool  # True when an identical complete corpus was already there


def _read_stamp(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        stamp = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}: not valid JSON ({err}); rebuild with --force") from None
    if not isinstance(stamp, dict) or "parameters" not in stamp:
        raise CorpusError(f"{path}: no 'parameters' key; rebuild with --force")
    return stamp


def build_corpus(
    out_dir: str | Path,
    kind: str,
    train: int,
    dev: int = DEFAULT_DEV_SIZE,
    seed: int = 1,
    workers: int | None = None,
    force: bool = False,
    progress: bool = True,
    durations: str = "natural",
    held_out_speakers: int = 0,
) -> CorpusSummary:
    """Synthesize the `train` and `dev` splits of a `kind` corpus under `out_dir` (see
    `plan_split` for `durations` and `held_out_speakers`).

    A complete corpus with the same parameters is left as it is; an interrupted one with the
    same parameters is resumed (finished FLACs are kept). Anything else already in the way is
    an error unless `force`, which deletes the splits and starts over.
    """
    root = Path(out_dir)
    sizes = {"train": train, "dev": dev}
    params = {"kind": kind, "seed": seed, "sizes": sizes, "format": FORMAT_VERSION}
    # recorded only when used, so that corpora made before the options stay valid
    if durations != "natural":
        params["durations"] = durations
    if held_out_speakers:
        params["held_out_speakers"] = held_out_speakers
    params["espeak_ng"] = espeak_ng_version()
    stamp_path = root / STAMP_NAME
    if force:
        for split in SPLIT_CODES:
            shutil.rmtree(root / split, ignore_errors=True)
        stamp_path.unlink(missing_ok=True)
    stamp = _read_stamp(stamp_path)
    if stamp is not None and stamp["parameters"] != params:
        raise CorpusError(
            f"{stamp_path}: the corpus there was made with {stamp['parameters']}, "
            f"not {params}; use another directory or --force to rebuild it"
        )
    if stamp is not None and stamp.get("complete"):
        return CorpusSummary(str(root), kind, seed, sizes, stamp["audio_seconds"], skipped=True)
    if stamp is None:
        occupied = [s for s in SPLIT_CODES if (root / s).exists() and any((root / s).iterdir())]
        if occupied:
            raise CorpusError(
                f"{root}: {', '.join(occupied)} already exist without {STAMP_NAME}; "
                "use another directory or --force to replace them"
            )
    # Planning checks the arguments, so it comes before anything is written.
    plans = [
        p
        for split, size in sizes.items()
        for p in plan_split(kind, split, size, seed, durations, held_out_speakers)
    ]
    root.mkdir(parents=True, exist_ok=True)
    stamp_path.write_text(json.dumps({"parameters": params, "complete": False}, indent=2) + "\n")
    samples = {}
    todo = []
    for plan in plans:
        path = root / plan.relative_audio
        if path.exists():  # finished by an interrupted run (writes are atomic)
            samples[plan.utt_id] = sf.info(str(path)).frames
        else:
            todo.append((plan, root))
    workers = max(1, workers or os.cpu_count() or 1)
    bar = tqdm(
        total=len(plans),
        initial=len(plans) - len(todo),
        disable=not progress,
        desc=f"espeak-ng {kind}",
        unit="utt",
    )
    if workers == 1 or len(todo) <= 1:
        results = map(_synthesize_job, todo)
        for (plan, _), n in zip(todo, results):
            samples[plan.utt_id] = n
            bar.update()
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for (plan, _), n in zip(todo, pool.imap(_synthesize_job, todo, chunksize=8)):
                samples[plan.utt_id] = n
                bar.update()
    bar.close()
    write_transcripts(plans, root)

    seconds = {split: 0.0 for split in sizes}
    for plan in plans:
        seconds[plan.split] += samples[plan.utt_id] / SAMPLE_RATE
    seconds = {split: round(s, 3) for split, s in seconds.items()}
    stamp = {"parameters": params, "complete": True, "audio_seconds": seconds}
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    return CorpusSummary(str(root), kind, seed, sizes, seconds, skipped=False)
