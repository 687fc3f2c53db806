"""End-to-end LibriSpeech download against a local HTTP server on 127.0.0.1 that serves small
archives in the real layout: MD5 check, resume after a cut connection, atomic extraction and
idempotent reruns."""

from __future__ import annotations

import hashlib
import http.server
import io
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from rnnt.prep.download import OFFICIAL_MD5, PARTS, DownloadError, main, read_md5_file


def _archive(part: str, seed: int) -> tuple[bytes, dict[str, bytes]]:
    """A tar.gz holding LibriSpeech/<part>/<spk>/<ch>/ with two FLACs and a transcript."""
    rng = np.random.default_rng(seed)
    files = {"LibriSpeech/README.TXT": b"LibriSpeech ASR corpus (test copy)\n"}
    d = f"LibriSpeech/{part}/{84 + seed}/121123"
    lines = []
    for i in range(2):
        utt = f"{84 + seed}-121123-{i:04d}"
        buf = io.BytesIO()
        sf.write(
            buf,
            (0.1 * rng.standard_normal(4000 * (i + 1))).astype(np.float32),
            16000,
            format="FLAC",
        )
        files[f"{d}/{utt}.flac"] = buf.getvalue()
        lines.append(f"{utt} WORDS NUMBER {i}")
    files[f"{d}/{84 + seed}-121123.trans.txt"] = ("\n".join(lines) + "\n").encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue(), files


class _Server:
    """Serves `files` (name -> bytes) with Range support; `cut[name] = n` closes the connection
    after n body bytes of the next full response for that name (once)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.cut, self.log = files, {}, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                outer.log.append((name, self.headers.get("Range")))
                data = outer.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                start, status = 0, 200
                m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if m:
                    start, status = int(m.group(1)), 206
                    if start >= len(data):
                        self.send_error(416)
                        return
                body = data[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                limit = outer.cut.pop(name, None)
                self.wfile.write(body if limit is None else body[:limit])
                if limit is not None:
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/resources/12"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served():
    archives, contents = {}, {}
    for seed, part in enumerate(["dev-clean", "test-clean"]):
        archives[f"{part}.tar.gz"], contents[part] = _archive(part, seed)
    server = _Server(archives)
    yield server, archives, contents
    server.close()


def _md5_file(tmp_path: Path, archives: dict[str, bytes], wrong: str = "") -> Path:
    lines = []
    for name, data in archives.items():
        digest = hashlib.md5(data).hexdigest()
        if name == wrong:
            digest = "0" * 32
        lines.append(f"{digest}  {name}")
    path = tmp_path / "md5sum.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(server, dest, md5_file, *extra):
    return ["--dest", str(dest), "--base-url", server.url, "--md5-file", str(md5_file)] + [
        "--no-progress",
        *extra,
    ]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_downloads_verifies_extracts_and_skips_on_rerun(served, tmp_path):
    server, archives, contents = served
    dest = tmp_path / "datasets"
    md5 = _md5_file(tmp_path, archives)
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "test-clean")) == 0
    expected = {k: v for files in contents.values() for k, v in files.items()}
    assert _tree(dest / "LibriSpeech") == {
        k.removeprefix("LibriSpeech/"): v for k, v in expected.items()
    }
    assert not (dest / "downloads" / "dev-clean.tar.gz").exists()  # removed after extraction
    assert sorted(p.name for p in dest.iterdir()) == [
        ".librispeech-download",
        "LibriSpeech",
        "downloads",
    ]
    assert len(server.log) == 2
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "test-clean")) == 0
    assert len(server.log) == 2  # both stages marked finished: no request at all
    shutil.rmtree(dest / "LibriSpeech" / "dev-clean")  # a marker without its tree is stale
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "test-clean")) == 0
    assert [name for name, _ in server.log[2:]] == ["dev-clean.tar.gz"]
    assert (dest / "LibriSpeech" / "dev-clean").is_dir()


def test_parts_picks_a_subset_and_keep_archives(served, tmp_path):
    server, archives, _ = served
    dest = tmp_path / "d"
    assert (
        main(
            _args(
                server,
                dest,
                _md5_file(tmp_path, archives),
                "--parts",
                "test-clean",
                "--keep-archives",
            )
        )
        == 0
    )
    assert [name for name, _ in server.log] == ["test-clean.tar.gz"]
    assert (dest / "LibriSpeech" / "test-clean").is_dir()
    assert not (dest / "LibriSpeech" / "dev-clean").exists()
    assert (dest / "downloads" / "test-clean.tar.gz").read_bytes() == archives["test-clean.tar.gz"]


def test_wrong_checksum_is_a_clear_error_and_extracts_nothing(served, tmp_path, capsys):
    server, archives, _ = served
    dest = tmp_path / "d"
    md5 = _md5_file(tmp_path, archives, wrong="dev-clean.tar.gz")
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "test-clean")) == 1
    err = capsys.readouterr().err
    actual = hashlib.md5(archives["dev-clean.tar.gz"]).hexdigest()
    assert f"dev-clean.tar.gz: MD5 mismatch: expected {'0' * 32}, got {actual}" in err
    assert "failed: dev-clean" in err
    assert not (dest / "LibriSpeech" / "dev-clean").exists()
    assert (dest / "LibriSpeech" / "test-clean").is_dir()  # the good part is unaffected
    assert not list(dest.glob(".extract-*"))
    assert (dest / "downloads" / "dev-clean.tar.gz.bad").read_bytes() == archives[
        "dev-clean.tar.gz"
    ]
    assert not (dest / "downloads" / "dev-clean.tar.gz").exists()


def test_interrupted_download_resumes_on_the_next_run(served, tmp_path, capsys):
    server, archives, contents = served
    dest = tmp_path / "d"
    md5 = _md5_file(tmp_path, archives)
    half = len(archives["dev-clean.tar.gz"]) // 2
    server.cut["dev-clean.tar.gz"] = half
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "--retries", "0")) == 1
    assert "download interrupted after" in capsys.readouterr().err
    part = dest / "downloads" / "dev-clean.tar.gz.part"
    assert part.stat().st_size == half
    assert not (dest / "LibriSpeech" / "dev-clean").exists()
    assert main(_args(server, dest, md5, "--parts", "dev-clean", "--retries", "0")) == 0
    assert server.log == [("dev-clean.tar.gz", None), ("dev-clean.tar.gz", f"bytes={half}-")]
    got = _tree(dest / "LibriSpeech" / "dev-clean")
    assert got == {
        k.removeprefix("LibriSpeech/dev-clean/"): v
        for k, v in contents["dev-clean"].items()
        if k.startswith("LibriSpeech/dev-clean/")
    }


def test_a_cut_is_resumed_within_one_run_through_the_shell_script(served, tmp_path, repo_root):
    server, archives, _ = served
    dest = tmp_path / "d"
    server.cut["test-clean.tar.gz"] = 1000
    cmd = ["bash", str(repo_root / "scripts" / "download_librispeech.sh")]
    cmd += _args(server, dest, _md5_file(tmp_path, archives), "--parts", "test-clean")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "interrupted at 1000 bytes" in done.stderr
    assert server.log == [("test-clean.tar.gz", None), ("test-clean.tar.gz", "bytes=1000-")]
    assert (dest / "LibriSpeech" / "test-clean").is_dir()


def _assert_refused(tmp_path: Path, members: list[tarfile.TarInfo]) -> None:
    """dev-clean served as an archive of `members` (files get one byte): the run fails and
    extracts nothing."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for info in members:
            if info.isfile():
                info.size = 1
            tar.addfile(info, io.BytesIO(b"x") if info.isfile() else None)
    server = _Server({"dev-clean.tar.gz": archive.getvalue()})
    try:
        dest = tmp_path / "refused"
        md5 = _md5_file(tmp_path, {"dev-clean.tar.gz": archive.getvalue()})
        assert main(_args(server, dest, md5, "--parts", "dev-clean")) == 1
    finally:
        server.close()
    assert not (dest / "LibriSpeech" / "dev-clean").exists()


def test_archive_with_members_outside_librispeech_is_refused(tmp_path):
    names = ["LibriSpeech/dev-clean/1/2/a.txt", "LibriSpeech/../../escape.txt"]
    _assert_refused(tmp_path, [tarfile.TarInfo(name) for name in names])
    assert not list(tmp_path.rglob("escape.txt"))


def test_md5_table_file_errors_name_the_line(tmp_path):
    path = tmp_path / "md5sum.txt"
    path.write_text(f"{OFFICIAL_MD5['dev-clean']}  dev-clean.tar.gz\nnot a checksum line\n")
    with pytest.raises(DownloadError, match=r"md5sum.txt:2: expected '<md5>  <part>.tar.gz'"):
        read_md5_file(path)
    assert set(PARTS) == {
        "train-clean-100",
        "train-clean-360",
        "train-other-500",
        "dev-clean",
        "dev-other",
        "test-clean",
        "test-other",
    }


def test_links_are_refused_and_a_python_without_tar_filters_still_extracts(
    served, tmp_path, monkeypatch
):
    """Debian 12's Python 3.11.2 has no tarfile data filter: the member checks alone guard the
    extraction there. A symlink in the archive is refused either way."""
    link = tarfile.TarInfo("LibriSpeech/dev-clean/link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    _assert_refused(tmp_path, [link])

    server, archives, contents = served
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    dest = tmp_path / "old_python"
    md5 = _md5_file(tmp_path, archives)
    assert main(_args(server, dest, md5, "--parts", "dev-clean")) == 0
    assert _tree(dest / "LibriSpeech") == {
        k.removeprefix("LibriSpeech/"): v for k, v in contents["dev-clean"].items()
    }
