import dataclasses
import json
import math
import subprocess
import sys

import pytest

from rnnt.run_log import METRICS_FILE, RunLog, read_metrics
from rnnt.throughput import WindowStats


def window(utts_per_s=1520.44, mfu=0.2125, peak_memory_gib=61.25, alloc_retries=0):
    return WindowStats(
        steps=10,
        utterances=1920,
        seconds=1920 / utts_per_s,
        data_wait_seconds=0.0125,
        utts_per_s=utts_per_s,
        step_ms=126.25,
        data_wait_share=0.0099,
        peak_memory_gib=peak_memory_gib,
        mfu=mfu,
        alloc_retries=alloc_retries,
    )


def strict_json(line):
    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def test_step_and_eval_lines_and_records(tmp_path, capsys):
    with RunLog(tmp_path, is_main=True) as log:
        log.info("starting")
        log.step(
            step=10,
            epoch=1,
            loss=52.25,
            lr=0.0031,
            loss_scale=512.0,
            skipped_steps=2,
            window=window(),
        )
        log.step(
            step=12,
            epoch=1,
            loss=50.0,
            lr=0.0031,
            loss_scale=512.0,
            skipped_steps=2,
            window=window(mfu=None, peak_memory_gib=None, alloc_retries=None),
        )
        log.eval(epoch=1, step=10, wer=0.2843, utterances=2703, seconds=1.93, data_seconds=0.41)
        log.step(
            step=20,
            epoch=1,
            loss=49.0,
            lr=0.0031,
            loss_scale=512.0,
            skipped_steps=2,
            window=window(alloc_retries=3),
        )
        log.eval(epoch=2, step=20, wer=0.25, utterances=2703, seconds=1.5, alloc_retries=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("] starting")
    assert out[1].endswith(
        "] epoch 1 step 10 | loss 52.2500 | lr 3.100e-03 | 1520.4 utt/s (126.2 ms/step) | "
        "data wait 1.0% | peak mem 61.2 GiB | MFU 21.2% | loss scale 512 | skipped steps 2"
    )
    assert out[2].endswith(  # no GPU: neither memory nor MFU
        "] epoch 1 step 12 | loss 50.0000 | lr 3.100e-03 | 1520.4 utt/s (126.2 ms/step) | "
        "data wait 1.0% | loss scale 512 | skipped steps 2"
    )
    assert out[3].endswith(
        "] epoch 1 step 10 | dev WER 28.430% | 2703 utterances in 1.93 s (waiting for data 0.41 s)"
    )
    assert out[4].endswith("| MFU 21.2% | allocator retries 3 | loss scale 512 | skipped steps 2")
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert out[5].endswith("(waiting for data 0.00 s) | allocator retries 2")
    train, cpu_train, ev, pressed, pressed_eval = (strict_json(line) for line in lines)
    assert pressed["alloc_retries"] == 3 and pressed_eval["alloc_retries"] == 2
    assert train.pop("time") > 0 and ev.pop("time") > 0
    assert train == {
        "kind": "train",
        "step": 10,
        "epoch": 1,
        "loss": 52.25,
        "lr": 0.0031,
        "utts_per_s": 1520.44,
        "step_ms": 126.25,
        "window_steps": 10,
        "data_wait_share": 0.0099,
        "peak_memory_gib": 61.25,
        "mfu": 0.2125,
        "alloc_retries": 0,
        "loss_scale": 512.0,
        "skipped_steps": 2,
    }
    assert not {"mfu", "peak_memory_gib", "alloc_retries"} & set(cpu_train)
    assert ev == {
        "kind": "eval",
        "epoch": 1,
        "step": 10,
        "wer": 0.2843,
        "utterances": 2703,
        "seconds": 1.93,
        "data_seconds": 0.41,
    }


def test_the_run_record_and_the_dropped_utterances(tmp_path, capsys):
    with RunLog(tmp_path, is_main=True) as log:
        log.run("3f9c0a1b22d4", 1234567, "drawn", world_size=8, resumed=False)
        log.step(
            step=3,
            epoch=1,
            loss=9.5,
            lr=1e-3,
            loss_scale=1.0,
            skipped_steps=0,
            window=window(mfu=None, peak_memory_gib=None),
            dropped_utterances=2,
        )
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(
        "] run 3f9c0a1b22d4 (fresh): seed 1234567 (drawn), 8 rank(s) derive theirs from it"
    )
    assert out[1].endswith("| loss scale 1 | skipped steps 0 | dropped utterances 2")
    run, train = read_metrics(tmp_path / METRICS_FILE)
    assert run.pop("time") > 0
    assert run == {
        "kind": "run",
        "run_id": "3f9c0a1b22d4",
        "seed": 1234567,
        "seed_source": "drawn",
        "world_size": 8,
        "resumed": False,
    }
    assert train["dropped_utterances"] == 2


def test_the_parts_of_the_data_wait(tmp_path, capsys):
    """From the torch loader, the data wait's parts follow its share on the line and go into
    the record each under its own key."""
    stats = dataclasses.replace(
        window(), data_wait_parts={"workers": 0.001, "queueing": 0.0025, "stage": 0.0061}
    )
    with RunLog(tmp_path, is_main=True) as log:
        log.step(step=3, epoch=1, loss=9.5, lr=1e-3, loss_scale=1.0, skipped_steps=0, window=stats)
    line = capsys.readouterr().out
    assert "| data wait 1.0% (workers 0.1%, queueing the stage 0.2%, the stage 0.6%) |" in line
    (train,) = read_metrics(tmp_path / METRICS_FILE)
    assert train["data_wait_workers_share"] == 0.001
    assert train["data_wait_queueing_share"] == 0.0025
    assert train["data_wait_stage_share"] == 0.0061
    assert "data_wait_parts" not in train


def test_the_hosts_lead_follows_the_data_wait_where_it_is_measured(tmp_path, capsys):
    """On a GPU the window knows how long the host waited for its end: the line says it after
    the data wait, and the record keeps it; a window without it (off CUDA) shows none."""
    point = dict(step=3, epoch=1, loss=9.5, lr=1e-3, loss_scale=1.0, skipped_steps=0)
    with RunLog(tmp_path, is_main=True) as log:
        log.step(**point, window=dataclasses.replace(window(), host_lead_ms=35.26))
        log.step(**point, window=window())
    led, unled = capsys.readouterr().out.splitlines()
    assert "| data wait 1.0% | host lead 35.3 ms | peak mem" in led
    assert "host lead" not in unled
    first, second = read_metrics(tmp_path / METRICS_FILE)
    assert first["host_lead_ms"] == 35.26
    assert "host_lead_ms" not in second


def test_non_finite_values_stay_valid_json(tmp_path):
    with RunLog(tmp_path) as log:
        log.step(
            step=1,
            epoch=1,
            loss=float("nan"),
            lr=1e-3,
            loss_scale=256.0,
            skipped_steps=1,
            window=window(utts_per_s=float("inf")),
        )
    record = strict_json((tmp_path / METRICS_FILE).read_text())
    assert record["loss"] == "nan" and record["utts_per_s"] == "inf"


def test_resumed_run_appends(tmp_path):
    for step in (1, 2):
        with RunLog(tmp_path) as log:
            log.eval(epoch=step, step=step, wer=0.5, utterances=3, seconds=0.1)
    assert [r["epoch"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]


def test_other_ranks_are_silent(tmp_path, capsys):
    log = RunLog(tmp_path / "out", is_main=False)
    log.info("x")
    log.step(step=1, epoch=1, loss=1.0, lr=1.0, loss_scale=1.0, skipped_steps=0, window=window())
    log.eval(epoch=1, step=1, wer=0.1, utterances=1, seconds=1.0)
    log.close()
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "out").exists()


def test_progress_bar_hidden_without_a_terminal(tmp_path):
    with RunLog(tmp_path) as log:
        bar = log.progress(range(5), total=5, desc="eval")
        assert bar.disable  # pytest's stderr is not a TTY
        assert list(bar) == [0, 1, 2, 3, 4]


def test_read_metrics_names_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": \n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object"):
        read_metrics(path)
    path.write_text('{"kind": "train"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: expected an object"):
        read_metrics(path)


def test_plot_script_writes_png(tmp_path, repo_root):
    with RunLog(tmp_path) as log:
        for step in range(1, 41):
            log.step(
                step=step,
                epoch=1 + step // 10,
                loss=100.0 / step,
                lr=1e-3 * min(step, 10),
                loss_scale=512.0,
                skipped_steps=0,
                window=window(),
            )
            if step % 10 == 0:
                log.eval(epoch=step // 10, step=step, wer=0.5 / step, utterances=2703, seconds=1)
        log.step(
            step=41,
            epoch=5,
            loss=float("nan"),
            lr=1e-3,
            loss_scale=256.0,
            skipped_steps=1,
            window=window(),
        )
    out = tmp_path / "curves.png"
    script = repo_root / "scripts" / "plot_metrics.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / METRICS_FILE), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 450)

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = subprocess.run(
        [sys.executable, str(script), str(bad)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "bad.jsonl:1" in result.stderr


def test_plot_script_compares_runs_epoch_by_epoch(tmp_path, repo_root):
    """Two runs: the table holds each epoch's mean logged loss and dev WER per run, and the
    summary the median step time of the windows after each epoch's first."""
    for name, scale in (("fast", 1.0), ("plain", 2.0)):
        with RunLog(tmp_path / name) as log:
            for step in range(1, 7):
                epoch = 1 + (step - 1) // 3
                log.step(
                    step=step,
                    epoch=epoch,
                    loss=scale * step,
                    lr=1e-3,
                    loss_scale=512.0,
                    skipped_steps=0,
                    window=window(),
                )
                if step % 3 == 0:
                    log.eval(
                        epoch=epoch, step=step, wer=scale * 0.1 / epoch, utterances=10, seconds=1
                    )
    script = repo_root / "scripts" / "plot_metrics.py"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            str(tmp_path / "fast" / METRICS_FILE),
            str(tmp_path / "plain" / METRICS_FILE),
            "--labels",
            "fast",
            "plain",
            "--table",
            "--out",
            str(tmp_path / "both.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "| epoch | fast loss | fast WER % | plain loss | plain WER % |" in lines
    assert "| 1 | 2.00 | 10.00 | 4.00 | 20.00 |" in lines  # losses 1,2,3 and 2,4,6
    assert "| 2 | 5.00 | 5.00 | 10.00 | 10.00 |" in lines
    assert lines[0].startswith("fast: 6 log points, median step")
    assert "first window 126.2 ms per step over 10 steps (1.0% data wait)" in lines[0]
    assert "last WER 5.00% (epoch 2)" in lines[0]
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"


def test_the_summary_gives_the_last_epochs_steady_state():
    """With several epochs, the summary adds the median of the last epoch's windows after its
    first: the first epoch's one-off costs past its first window (the dev set's workers
    starting halfway through it) stay out of it."""
    from rnnt.cli.plot_metrics import summary

    def point(epoch: int, step_ms: float) -> dict:
        return {
            "kind": "train",
            "epoch": epoch,
            "step_ms": step_ms,
            "data_wait_share": 0.1,
            "window_steps": 10,
        }

    records = [point(1, ms) for ms in (400.0, 120.0, 300.0, 118.0)]
    records += [point(2, ms) for ms in (125.0, 116.0, 115.0, 117.0)]
    line = summary("real", records)
    assert "median step 117.50 ms over 6 windows" in line
    assert "last epoch's median step 116.00 ms over 3 windows" in line
    assert "last epoch" not in summary("real", records[:4])
    assert summary("none", []) == "none: 0 log points"
    assert "median data wait 10.0%," in line  # no parts without the torch loader's
    for record, stage in zip(records, (0.5, 0.04, 0.3, 0.06, 0.5, 0.05, 0.07, 0.05)):
        record.update(data_wait_workers_share=0.01, data_wait_stage_share=stage)
    assert "median data wait 10.0% (workers 1.0%, stage 5.5%)," in summary("real", records)
    assert "host lead" not in line  # off CUDA
    for record, lead in zip(records, (0.0, 40.0, 2.0, 30.0, 0.0, 20.0, 10.0, 50.0)):
        record["host_lead_ms"] = lead
    # each epoch's first window left out: the median of 40, 2, 30, 20, 10 and 50
    assert "median host lead 25.0 ms" in summary("real", records)


def test_the_band_places_each_run_against_a_reference_groups_range(tmp_path, repo_root):
    """--band plain: the plain runs' mean and range at the epochs they share, every other
    run's dev WER relative to that mean, and how many lie inside the range."""
    from rnnt.cli.plot_metrics import band

    def evals(wers: dict[int, float]) -> list[dict]:
        return [{"kind": "eval", "epoch": e, "wer": w} for e, w in wers.items()]

    runs = {
        "plain s1": evals({9: 0.40, 10: 0.20}),
        "plain s2": evals({9: 0.60, 10: 0.30, 11: 0.1}),
        "fast s1": evals({1: 0.99, 9: 0.55, 10: 0.35}),
        "fast s2": evals({9: 0.30, 10: 0.25}),
    }
    ref, others = band(runs, "plain")
    assert ref.epochs == [9, 10]  # 11: not every plain run has it
    assert ref.mean == pytest.approx([0.50, 0.25])
    assert ref.low == pytest.approx([-20.0, -20.0]) and ref.high == pytest.approx([20.0, 20.0])
    assert list(others) == ["fast s1", "fast s2"]
    assert [e for e, _ in others["fast s1"]] == [9, 10]  # its epoch 1 has no plain mean
    assert [r for _, r in others["fast s1"]] == pytest.approx([10.0, 40.0])
    assert [r for _, r in others["fast s2"]] == pytest.approx([-40.0, 0.0])
    with pytest.raises(ValueError, match="at least two runs labelled cudnn"):
        band(runs, "cudnn")

    paths = []
    for name, records in runs.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(str(path))
    script = repo_root / "scripts" / "plot_metrics.py"
    out = tmp_path / "band.png"
    args = [sys.executable, str(script), *paths, "--labels", *runs, "--band", "plain"]
    result = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        "epoch 9: plain mean 50.00% (range -20.0% to +20.0%); others 1 of 2 inside, 0 above, "
        "1 below" in lines
    )
    assert (
        "epoch 10: plain mean 25.00% (range -20.0% to +20.0%); others 1 of 2 inside, 1 above, "
        "0 below" in lines
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 1800  # the third panel
    result = subprocess.run([*args[:-1], "fast s1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "error: --band fast s1: needs at least two runs labelled fast s1..., got 1"
    )


def test_every_run_keeps_one_color_in_every_panel_and_one_legend_names_it():
    """Eleven runs: eleven colors (a cycle of ten gave the first and the eleventh one), each
    run's loss, WER and band curves in its own, and one legend under the panels instead of
    one over each panel's curves."""
    import matplotlib.pyplot as plt

    from rnnt.cli.plot_metrics import band, figure, run_colors

    names = [f"plain s{i}" for i in range(1, 5)] + [f"fast s{i}" for i in range(1, 8)]
    colors = run_colors(names)
    assert len(set(colors.values())) == 11
    assert list(run_colors(["a", "b"]).values()) == list(plt.get_cmap("tab10").colors[:2])

    def records(offset: float) -> list[dict]:
        train = [
            {"kind": "train", "step": s, "epoch": 9, "loss": 50.0 + s, "lr": 1e-3} for s in (1, 2)
        ]
        return train + [{"kind": "eval", "epoch": e, "wer": 0.4 / e + offset} for e in (9, 10)]

    runs = {name: records(0.001 * i) for i, name in enumerate(names)}
    fig = figure(runs, ("plain", *band(runs, "plain")))
    ax_loss, ax_wer, ax_band = fig.axes[:3]
    assert [line.get_color() for line in ax_loss.get_lines()] == [colors[n] for n in names]
    assert [line.get_color() for line in ax_wer.get_lines()[:11]] == [colors[n] for n in names]
    band_lines = [line for line in ax_band.get_lines() if line.get_color() != "tab:gray"]
    assert [line.get_color() for line in band_lines] == [colors[n] for n in names[4:]]
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == [*names, "learning rate", "MLPerf target 5.8%", "plain runs' range"]
    plt.close(fig)


def test_scores_inside_epochs_sit_at_fractional_epochs():
    """Epochs of 10 steps, evaluated at steps 90 and 100 (epochs 9 and 10): a score at step 93
    is epoch 9.3; without two epochs' evaluations there is no scale."""
    from rnnt.cli.plot_metrics import epoch_table, mid_epoch_points

    records = [
        {"kind": "eval", "epoch": 9, "step": 90, "wer": 0.8},
        {"kind": "mid_epoch_eval", "epoch": 10, "step": 93, "wer": 0.7},
        {"kind": "mid_epoch_eval", "epoch": 10, "step": 96, "wer": 0.6},
        {"kind": "eval", "epoch": 10, "step": 100, "wer": 0.5},
    ]
    assert mid_epoch_points(records) == [(pytest.approx(9.3), 0.7), (pytest.approx(9.6), 0.6)]
    assert mid_epoch_points(records[:3]) == []
    assert "| 10 |  | 50.00 |" in epoch_table({"run": records}).splitlines()


def test_paired_runs_give_the_steps_a_group_trails_by_in_training_loss():
    """Reference losses fall as exp(-0.01 step); a group's seed 1 runs 1 step behind its
    reference and seed 2 3 steps behind: 2 +- 1 steps, from the log ratios 0.01 and 0.03.
    Runs without a seed in their label, and seeds without a reference, are left out."""
    from rnnt.cli.plot_metrics import paired_lag

    def run(lag: float, steps=range(1, 21)) -> list[dict]:
        return [
            {
                "kind": "train",
                "step": k,
                "epoch": 1 + (k - 1) // 10,
                "loss": 100 * math.exp(-0.01 * (k - lag)),
            }
            for k in steps
        ]

    runs = {
        "plain s1": run(0),
        "plain s2": run(0),
        "fast s1": run(1),
        "fast s2": run(3),
        "fast s7": run(50),  # no plain s7
        "other": run(50),
    }
    lines = paired_lag(runs, "plain")
    assert lines == [
        f"fast against plain, epoch {e}: training loss +2.00% (+-1.00%, 2 seeds), "
        "+2.0 +- 1.0 steps behind"
        for e in (1, 2)
    ]
    with pytest.raises(ValueError, match="labelled 'cudnn sN' for 2\\+ seeds"):
        paired_lag(runs, "cudnn")


def test_paired_runs_give_the_steps_a_group_trails_by_in_dev_wer():
    """Reference WERs fall by 0.01 a step, scored inside epochs and at their ends; a group's
    seed 1 is 1 step behind and seed 2 3 steps: +2 points, 2 +- 1 steps at every score both
    have. A step that one reference run was not scored at is left out; so is the step only one
    seed of the group reached."""
    from rnnt.cli.plot_metrics import paired_wer_lag

    def run(lag: float, steps=(10, 15, 20, 25, 30)) -> list[dict]:
        return [
            {
                "kind": "eval" if k % 10 == 0 else "mid_epoch_eval",
                "step": k,
                "epoch": (k + 9) // 10,
                "wer": 0.9 - 0.01 * (k - lag),
            }
            for k in steps
        ]

    runs = {
        "plain s1": run(0),
        "plain s2": run(0, steps=(10, 15, 20, 30)),
        "fast s1": run(1),
        "fast s2": run(3, steps=(10, 15, 20, 25)),
    }
    lines = paired_wer_lag(runs, "plain")
    assert lines == [
        f"fast against plain, dev WER at step {k} (epoch {e}): +2.00 points (+-1.00, 2 seeds), "
        "+2.0 +- 1.0 steps behind"
        for k, e in ((10, 1), (15, 2), (20, 2))
    ]
    assert paired_wer_lag({"plain s1": run(0), "plain s2": run(0, steps=(10,))}, "plain") == []


def test_the_band_takes_the_scores_inside_epochs_that_every_reference_run_has():
    """Epochs of 10 steps scored every 5: the band lies at epochs 9, 9.5 and 10; the score at
    9.8 only one plain run has is left out of the band, and epoch 9.5's line names it."""
    from rnnt.cli.plot_metrics import band, band_lines

    def run(wers: dict[int, float]) -> list[dict]:
        return [
            {"kind": "eval" if k % 10 == 0 else "mid_epoch_eval", "epoch": 10, "step": k, "wer": w}
            | ({"epoch": k // 10} if k % 10 == 0 else {})
            for k, w in wers.items()
        ]

    runs = {
        "plain a": run({90: 0.8, 95: 0.6, 98: 0.5, 100: 0.4}),
        "plain b": run({90: 0.8, 95: 0.4, 100: 0.4}),
        "fast": run({90: 0.8, 95: 0.55, 98: 0.45, 100: 0.44}),
    }
    ref, others = band(runs, "plain")
    assert ref.epochs == [9, 9.5, 10]
    assert ref.low == pytest.approx([0.0, -20.0, 0.0]) and ref.high == pytest.approx([0, 20, 0])
    assert others["fast"] == [(9, 0.0), (9.5, pytest.approx(10.0)), (10, pytest.approx(10.0))]
    assert band_lines("plain", ref, others)[1] == (
        "epoch 9.50: plain mean 50.00% (range -20.0% to +20.0%); others 1 of 1 inside, "
        "0 above, 0 below"
    )
