"""`pdunit bench stacks`: a --sample-stacks file summarized per thread."""

from __future__ import annotations

from pdunit.bench import stacks


def test_bench_stacks_summarizes_each_thread(tmp_path, capsys):
    folded = tmp_path / "p.folded"
    folded.write_text("forward;worker.py:_step_once;runner.py:run_prefill 30\n"
                      "forward;worker.py:_step_once;threading.py:wait 10\n"
                      "reserve;worker.py:_reserve_once;_channel.py:__call__ 20\n")
    assert stacks.main(["--file", str(folded), "--out", str(tmp_path / "s.md")]) == 0
    out = capsys.readouterr().out
    assert "| forward | 40 | 66.7% |" in out and "| reserve | 20 | 33.3% |" in out
    assert "| runner.py:run_prefill | 75.0% |  | worker.py:_step_once | 100.0% |" in out
    assert (tmp_path / "s.md").read_text().startswith("# Sampled stacks")
    folded.write_text("not folded\n")
    assert stacks.main(["--file", str(folded)]) == 2
    assert "not a folded stack line" in capsys.readouterr().err
