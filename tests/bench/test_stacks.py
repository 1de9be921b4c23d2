"""`pdunit bench stacks`: a --sample-stacks file summarized per thread."""

from __future__ import annotations

from pdunit.bench import stacks


def test_bench_stacks_summarizes_each_thread(tmp_path, capsys):
    folded = tmp_path / "p.folded"
    folded.write_text("forward;worker.py:_step_once;runner.py:run_prefill 30\n"
                      "forward;worker.py:_step_once;threading.py:wait 10\n"
                      "reserve;worker.py:_reserve_once;_channel.py:__call__ 20\n"
                      "grpc;threading.py:_bootstrap;_channel.py:_blocking 5\n")
    assert stacks.main(["--file", str(folded), "--out", str(tmp_path / "s.md")]) == 0
    out = capsys.readouterr().out
    # outside known waits: forward's run_prefill (30 of 40), all of reserve's __call__
    assert "| forward | 40 | 61.5% | 75.0% |" in out and "| reserve | 20 | 30.8% | 100.0% |" in out
    assert "| grpc | 5 | 7.7% | 0.0% |" in out  # blocked in a gRPC call: a known wait
    assert "| runner.py:run_prefill | 75.0% |  | worker.py:_step_once | 100.0% |" in out
    assert (tmp_path / "s.md").read_text().startswith("# Sampled stacks")
    folded.write_text("not folded\n")
    assert stacks.main(["--file", str(folded)]) == 2
    assert "not a folded stack line" in capsys.readouterr().err
