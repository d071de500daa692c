"""``headwise.bench.greedy``: every way timed on equal indices, and the module runs tiny."""

from headwise.bench import greedy as bench


def test_main_prints_one_row_per_vocab_and_batch_under_a_header_naming_the_cpu(capsys):
    bench.main(["--repeats", "2", "--vocabs", "1024,100", "--batches", "1,3"])
    out = capsys.readouterr().out.splitlines()
    assert "family" in out[0]
    assert [line.split(" | ")[:2] for line in out if line.startswith("| 1")] == [["| 1024", "1"], ["| 1024", "3"], ["| 100", "1"], ["| 100", "3"]]


def test_rows_hold_every_time():
    (row,) = bench.greedy_speeds([1024], [2], repeats=2)
    assert (row.vocab, row.batch) == (1024, 2) and row.argmax_us > 0 and row.chunks_us > 0 and row.greedy_us > 0
    assert row.op == bench.native.built()
