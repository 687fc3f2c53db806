"""Download LibriSpeech from OpenSLR: MD5-checked, resumable, atomic extraction, idempotent.

  python -m rnnt.prep.download --dest datasets [--parts dev-clean ...] [--base-url URL]

Per part, under `<dest>`:
  downloads/<part>.tar.gz.part   a download in progress; the next run resumes it (HTTP Range)
  downloads/<part>.tar.gz        complete; its MD5 is checked against the published table
  downloads/<part>.tar.gz.bad    an archive whose MD5 did not match, kept for inspection; the
                                 next run downloads the part again from scratch
  LibriSpeech/<part>/            extracted into a temporary directory inside <dest>, then
                                 renamed, so a failed extraction never leaves a half tree
  .librispeech-download/<part>.verified / .extracted   stage markers: finished stages are
                                 skipped on a rerun
The archive is deleted after extraction unless --keep-archives is given.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import re
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

DEFAULT_BASE_URL = "https://www.openslr.org/resources/12"
# Published in https://www.openslr.org/resources/12/md5sum.txt (resource 12 = LibriSpeech ASR).
OFFICIAL_MD5 = {
    "train-clean-100": "2a93770f6d5c6c964bc36631d331a522",
    "train-clean-360": "c0e676e450a7ff2f54aeade5171606fa",
    "train-other-500": "d1a0fd59409feb2c614ce4d30c387708",
    "dev-clean": "42e2234ba48799c1f50f24a7926300a1",
    "dev-other": "c8d0bcc9cca99d4f8b62fcc847357931",
    "test-clean": "32fa31d27d2e1cad72775fee3f4849a9",
    "test-other": "fb5a50374b501bb3bac4815ee91d3135",
}
PARTS = tuple(OFFICIAL_MD5)
TOP_DIR = "LibriSpeech"  # every member of an official archive lives under it
STATE_DIR = ".librispeech-download"
CHUNK = 1 << 20


class DownloadError(RuntimeError):
    pass


def read_md5_file(path: str | Path) -> dict[str, str]:
    """Parse `md5sum` output (`<md5>  <part>.tar.gz` per line), e.g. a mirror's md5sum.txt."""
    table = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{32})\s+\*?(\S+)\.tar\.gz\s*", line)
        if not m:
            raise DownloadError(f"{path}:{lineno}: expected '<md5>  <part>.tar.gz', got {line!r}")
        table[m.group(2)] = m.group(1).lower()
    return table


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _fetch_once(url: str, part_file: Path, timeout: float, progress: bool) -> None:
    """Append the rest of `url` to `part_file`; raises OSError/HTTPException when cut short."""
    from tqdm import tqdm

    have = part_file.stat().st_size if part_file.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # nothing left past `have`: the .part is complete
            return
        raise DownloadError(f"{url}: HTTP {err.code} {err.reason}") from None
    with response:
        if response.status == 206:
            m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != have:
                raise DownloadError(f"{url}: unexpected Content-Range for a resume from {have}")
            total = int(m.group(2)) if m.group(2) != "*" else None
            mode = "ab"
        else:  # the server ignored the Range request: start again
            have, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
        bar = tqdm(
            total=total,
            initial=have,
            unit="B",
            unit_scale=True,
            desc=part_file.name.removesuffix(".part"),
            disable=not progress,
            leave=False,
        )
        with open(part_file, mode) as fh, bar:
            while block := response.read(CHUNK):
                fh.write(block)
                bar.update(len(block))
    size = part_file.stat().st_size
    if total is not None and size != total:
        raise http.client.IncompleteRead(b"", total - size)


def download(url: str, archive: Path, retries: int, timeout: float, progress: bool) -> None:
    """Download `url` to `archive` through `archive.part`, resuming after each failure."""
    part_file = archive.with_name(archive.name + ".part")
    archive.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(retries + 1):
        try:
            _fetch_once(url, part_file, timeout, progress)
            os.replace(part_file, archive)
            return
        except (OSError, http.client.HTTPException) as err:
            have = part_file.stat().st_size if part_file.exists() else 0
            if attempt == retries:
                raise DownloadError(
                    f"{url}: download interrupted after {have} bytes ({type(err).__name__}: "
                    f"{err}); {part_file} is kept and the next run resumes it"
                ) from None
            print(f"{url}: interrupted at {have} bytes ({err}), resuming", file=sys.stderr)


def _check_members(archive: Path, tar: tarfile.TarFile) -> None:
    """LibriSpeech's archives hold files and folders under LibriSpeech/ and nothing else: any
    other member (a path out of it, a link, a device) refuses the archive before anything is
    written. This is what keeps extraction safe where tarfile has no "data" filter (Python
    before 3.10.12 and 3.11.4, such as Debian 12's 3.11.2)."""
    for member in tar.getmembers():
        parts = Path(member.name).parts
        if not parts or parts[0] != TOP_DIR or ".." in parts:
            raise DownloadError(f"{archive}: member {member.name!r} is outside {TOP_DIR}/")
        if not (member.isfile() or member.isdir()):
            raise DownloadError(f"{archive}: member {member.name!r} is not a file or a folder")


def extract(archive: Path, dest: Path, part: str) -> Path:
    """Unpack `archive` and move `LibriSpeech/<part>` into `dest/LibriSpeech/` in one rename."""
    tmp = dest / f".extract-{part}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            _check_members(archive, tar)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)  # every member was checked above
        src = tmp / TOP_DIR / part
        if not src.is_dir():
            raise DownloadError(f"{archive}: no {TOP_DIR}/{part}/ directory inside")
        target_root = dest / TOP_DIR
        target_root.mkdir(parents=True, exist_ok=True)
        target = target_root / part
        if target.exists():  # a run that died between rename and marker: replace its tree
            shutil.rmtree(target)
        os.replace(src, target)
        for extra in sorted((tmp / TOP_DIR).iterdir()):  # README.TXT, SPEAKERS.TXT, ...
            if extra.is_file() and not (target_root / extra.name).exists():
                os.replace(extra, target_root / extra.name)
        return target
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DownloadError(f"{archive}: extraction failed: {err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_part(
    part: str,
    dest: Path,
    *,
    base_url: str,
    md5: str,
    retries: int = 3,
    timeout: float = 60.0,
    keep_archive: bool = False,
    progress: bool = True,
) -> str:
    """Download, verify and extract one part; returns what was done (for the log line)."""
    state = dest / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    extracted, verified = state / f"{part}.extracted", state / f"{part}.verified"
    if extracted.exists() and (dest / TOP_DIR / part).is_dir():
        return "already extracted"
    archive = dest / "downloads" / f"{part}.tar.gz"
    if not (verified.exists() and archive.exists()):
        verified.unlink(missing_ok=True)
        if not archive.exists():
            download(f"{base_url.rstrip('/')}/{part}.tar.gz", archive, retries, timeout, progress)
        actual = md5sum(archive)
        if actual != md5:
            bad = archive.with_name(archive.name + ".bad")
            os.replace(archive, bad)
            raise DownloadError(
                f"{archive}: MD5 mismatch: expected {md5}, got {actual}; nothing was extracted, "
                f"the file is kept as {bad} for inspection and the next run downloads it again"
            )
        verified.write_text(f"{actual}  {archive.name}\n")
    target = extract(archive, dest, part)
    extracted.write_text(f"{target}\n")
    if not keep_archive:
        archive.unlink()
    return f"extracted to {target}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--dest", default="datasets", help="LibriSpeech/ is created inside it")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, metavar="PART")
    ap.add_argument("--base-url", default=DEFAULT_BASE_URL, help="mirror serving <part>.tar.gz")
    ap.add_argument("--md5-file", help="md5sum-style table replacing the official sums")
    ap.add_argument("--retries", type=int, default=3, help="resumed attempts after a cut")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without data")
    ap.add_argument("--keep-archives", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    try:
        table = read_md5_file(args.md5_file) if args.md5_file else OFFICIAL_MD5
    except (DownloadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    failed = []
    for part in args.parts:
        if part not in table:
            print(f"{part}: error: no MD5 for it in {args.md5_file}", file=sys.stderr)
            failed.append(part)
            continue
        try:
            done = prepare_part(
                part,
                Path(args.dest),
                base_url=args.base_url,
                md5=table[part],
                retries=args.retries,
                timeout=args.timeout,
                keep_archive=args.keep_archives,
                progress=not args.no_progress,
            )
            print(f"{part}: {done}")
        except DownloadError as err:
            print(f"{part}: error: {err}", file=sys.stderr)
            failed.append(part)
    if failed:
        print(f"failed: {' '.join(failed)} (rerun to resume)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
