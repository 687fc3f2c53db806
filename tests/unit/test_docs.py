"""docs/SPEC.md is the benchmark's reference inside the repository: every citation of it resolves
to a section that exists, nothing points outside the repository, and its tables agree with the
code that implements them."""

import re
import subprocess
from pathlib import Path

from rnnt.config import GBS_PRESETS
from rnnt.model import RNNT, ModelConfig, count_parameters

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "SPEC.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".sh", ".sub", ".toml", ".cfg", ".txt"}
SKIP_DIRS = {".git", ".venv", "datasets", "results", "__pycache__", "build"}


def _repo_files() -> list[Path]:
    """What the repository holds: git's tracked files and the untracked ones it does not ignore,
    so that a scratch folder or a copy of another tree under an ignored path is not read as part
    of it. A copy without git (the GPU machine's): the tree, less the folders of no sources."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        listed = None
    if listed:  # not empty: a copy inside another repository's ignored folder lists nothing
        return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]
    return [
        path
        for path in ROOT.rglob("*")
        if path.is_file()
        and not any(
            part in SKIP_DIRS or part.endswith(".egg-info") for part in path.relative_to(ROOT).parts
        )
    ]


def _repo_text_files() -> list[Path]:
    return [
        path for path in _repo_files() if path.suffix in TEXT_SUFFIXES or path.name == "Dockerfile"
    ]


def _sections(doc: Path = SPEC) -> set[str]:
    """Every heading of `doc`, also without its closing "(machine, date)" if it has one: a
    citation names the section by its title."""
    titles = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M)}
    return titles | {re.sub(r" \([^()]*\)$", "", t) for t in titles}


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under `heading` in docs/SPEC.md, header excluded."""
    lines = SPEC.read_text().split(f"## {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), None)
    rows = lines[start:end]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def test_every_citation_of_the_specs_and_the_performance_notes_names_a_section():
    """`docs/SPEC.md "Model"`, `docs/PERFORMANCE.md "Chunk size"` or `(docs/PERFORMANCE.md,
    "Chunk size")`: the section must exist (a quoted name may wrap onto a comment's next
    line)."""
    docs = {"SPEC": SPEC, "PERFORMANCE": ROOT / "docs" / "PERFORMANCE.md"}
    sections = {name: _sections(path) for name, path in docs.items()}
    assert {"Model", "Data", "Training", "Evaluation", "Logging"} <= sections["SPEC"]
    cited, unresolved = {name: 0 for name in docs}, []
    pattern = r"(\S*)(SPEC|PERFORMANCE)\.md`?(?:,? \"([^\"]+)\")?"
    for path in _repo_text_files():
        if path in (*docs.values(), Path(__file__)):
            continue
        for match in re.finditer(pattern, path.read_text(errors="replace")):
            prefix, doc, section = match.groups()
            cited[doc] += 1
            if section:
                section = " ".join(re.sub(r"\n\s*#", " ", section).split())
            # a bare name is the one in docs/ (the only file of that name); a path must be docs/
            if re.split(r"[\[(`]", prefix)[-1] not in ("", "docs/") or (
                section and section not in sections[doc]
            ):
                unresolved.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert cited["SPEC"] >= 20 and cited["PERFORMANCE"] >= 10
    assert not unresolved, unresolved
    for doc in docs.values():
        same_name = [p.relative_to(ROOT) for p in _repo_files() if p.name == doc.name]
        assert same_name == [doc.relative_to(ROOT)]


def test_nothing_in_the_repository_points_outside_it():
    outside = [
        str(p.relative_to(ROOT))
        for p in _repo_text_files()
        if p != Path(__file__) and "../shared" in p.read_text(errors="replace")
    ]
    assert not outside


def test_the_hyperparameter_table_is_the_presets_of_the_config():
    rows = _table("Hyperparameters by global batch size")
    table = {f"gbs{r[0]}": tuple(float(x) for x in r[1:]) for r in rows}
    presets = {name: tuple(float(x) for x in values) for name, values in GBS_PRESETS.items()}
    assert table == presets


def test_the_model_table_adds_up_to_the_baseline_model():
    counts = [int(r[2].replace(",", "")) for r in _table("Model")]
    model = RNNT(ModelConfig())
    assert sum(counts) == count_parameters(model) == 49_071_616
    parts = {
        "pre_rnn": model.encoder.pre_rnn,
        "post_rnn": model.encoder.post_rnn,
        "joint_enc": model.encoder.joint_enc,
        "dec_rnn": model.prediction.dec_rnn,
        "joint_pred": model.prediction.joint_pred,
        "fc": model.joint.fc,
    }
    for row in _table("Model"):
        name = re.search(r"`(\w+)`", row[0])
        if name and name.group(1) in parts:
            assert int(row[2].replace(",", "")) == count_parameters(parts[name.group(1)]), row
