"""tools.plot: PNGs from a run's metrics.jsonl."""

import json

import pytest

pytest.importorskip("matplotlib")

from tools.plot import MetricsError, main, plot_run, read_metrics  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail, encoding="utf-8")


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_main_writes_one_png_per_plot_with_data(tmp_path, capsys):
    run = tmp_path / "run"
    _write_metrics(run, [
        {"step": s, "critic/score/mean": 0.1 * s, "actor/ppo_kl": 0.01 * s, "actor/kl_loss": 0.02,
         "response_length/mean": 10 + s, "perf/throughput": 1000.0 + s}
        for s in range(1, 6)
    ] + [{"step": 5, "val/meshppo/demo_add/score": 0.4, "val/openai/gsm8k/score": 0.2}])
    out = tmp_path / "plots"
    assert main([str(run), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["kl.png", "response_length.png", "reward.png", "throughput.png"]
    assert all(_is_png(out / name) for name in names)
    assert capsys.readouterr().out.split() == [str(out / n) for n in
                                               ("reward.png", "kl.png", "response_length.png", "throughput.png")]


def test_plots_without_data_are_skipped_and_out_defaults_to_run_dir(tmp_path):
    run = tmp_path / "run"
    # Only rewards (one of them only on the validation line); a NaN and a string value are ignored.
    _write_metrics(run, [{"step": 1, "critic/score/mean": 0.5, "actor/ppo_kl": float("nan")},
                         {"step": 2, "critic/score/mean": "n/a", "val/x/score": 1.0}])
    written = plot_run(run)
    assert written == [str(run / "reward.png")]
    assert _is_png(run / "reward.png") and not (run / "kl.png").exists()


def test_truncated_last_line_is_ignored_but_a_bad_middle_line_is_an_error(tmp_path):
    run = tmp_path / "run"
    _write_metrics(run, [{"step": 1, "perf/throughput": 5.0}], tail='{"step": 2, "perf/thr')
    assert read_metrics(run / "metrics.jsonl") == [{"step": 1, "perf/throughput": 5.0}]
    assert main([str(run)]) == 0 and _is_png(run / "throughput.png")

    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:2: malformed JSON"):
        read_metrics(run / "metrics.jsonl")


def test_a_string_metric_with_a_unicode_line_separator_is_one_line(tmp_path):
    # the trainer writes metrics.jsonl with ensure_ascii=False: U+2028/U+2029/U+0085 stay unescaped in strings
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 1, "note": "a\u2028b\u2029c\u0085d", "perf/throughput": 5.0}, {"step": 2, "perf/throughput": 6.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                       encoding="utf-8")
    assert read_metrics(run / "metrics.jsonl") == records


def test_missing_file_and_nothing_to_plot_exit_1(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "metrics file not found: " in capsys.readouterr().err
    _write_metrics(tmp_path / "run", [{"step": 1, "timing_s/gen": 2.0}])
    assert main([str(tmp_path / "run")]) == 1
    assert "no plottable metrics" in capsys.readouterr().err


@pytest.fixture
def drawn(monkeypatch):
    """The y label and legend of every figure plot_run saves, by file name."""
    import matplotlib.figure

    seen = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        seen[str(path).rsplit("/", 1)[-1]] = (ax.get_ylabel(), [t.get_text() for t in ax.get_legend().get_texts()])
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return seen


@pytest.mark.parametrize("device,worker", [("cpu", "CPU rank"), ("cuda", "GPU"), (None, "rank")])
def test_throughput_label_names_what_the_run_ran_on(tmp_path, drawn, device, worker):
    run = tmp_path / "run"
    _write_metrics(run, [{"step": 1, "perf/throughput": 10.0}, {"step": 2, "perf/throughput": 12.0}])
    if device is not None:  # the trainer writes run_info.json; an older run directory has none
        (run / "run_info.json").write_text(json.dumps({"device": device, "world_size": 2}))
    plot_run(run)
    assert drawn["throughput.png"][0] == f"tokens / s / {worker}"


def test_kl_plot_shows_the_progress_bar_kl_and_the_kl_in_reward(tmp_path, drawn):
    run = tmp_path / "run"
    _write_metrics(run, [{"step": s, "actor/ref_kl": 0.01 * s, "actor/ppo_kl": 0.001, "actor/reward_kl_penalty": 0.02,
                          "actor/reward_kl_penalty_coeff": 0.001} for s in (1, 2, 3)])
    plot_run(run)
    # the coefficient is not a KL: it stays off the KL axis
    assert sorted(drawn["kl.png"][1]) == ["actor/ppo_kl", "actor/ref_kl", "actor/reward_kl_penalty"]


@pytest.mark.parametrize("out, message", [
    ("afile/plots", "cannot write plots to {tmp}/afile/plots: Not a directory"),
    ("afile", "cannot write plots to {tmp}/afile: it is a file, not a directory"),
])
def test_unwritable_out_is_a_one_line_error(tmp_path, capsys, out, message):
    run = tmp_path / "run"
    _write_metrics(run, [{"step": 1, "perf/throughput": 5.0}])
    (tmp_path / "afile").write_text("x")
    assert main([str(run), "--out", str(tmp_path / out)]) == 1
    assert capsys.readouterr().err == "error: " + message.format(tmp=tmp_path) + "\n"


def test_a_png_that_cannot_be_written_is_an_error(tmp_path, capsys):
    run = tmp_path / "run"
    _write_metrics(run, [{"step": 1, "perf/throughput": 5.0}])
    (run / "throughput.png").mkdir()  # a directory where the PNG goes
    assert main([str(run)]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot write {run / 'throughput.png'}: ")
