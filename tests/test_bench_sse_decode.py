"""bench/sse_decode.py in a tiny run, so it cannot rot: it decodes, times every path and prints
its table. (No timing is asserted: figures belong to the benchmark, not to a test.)"""

from __future__ import annotations

import re

import pytest

from bench import sse_decode


def test_sse_decode_bench_prints_a_figure_for_every_cut_and_decoder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sse_decode.main(["--tokens", "12", "--streams", "2", "--rounds", "2"])

    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "| " + " | ".join(sse_decode.REPORT_HEADERS) in re.sub(r" +", " ", out)
    assert set(rows) == {"reads", *sse_decode.CUTS}
    for cut in sse_decode.CUTS:
        cells = [cell.strip() for cell in rows[cut].split("|")[2:-1]]
        assert len(cells) == len(sse_decode.REPORT_HEADERS) - 1
        assert all(re.fullmatch(r"-?\d+\.\d\d|n/a", cell) for cell in cells), cells
        assert float(cells[0]) > 0  # the raw read takes some time


async def test_sse_decode_bench_refuses_a_decoder_that_decodes_wrongly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def drops_the_last_event(chunks: object) -> list[str]:
        return (await sse_decode.httpx_sse(chunks))[:-1]  # type: ignore[arg-type]

    monkeypatch.setitem(sse_decode.PATHS, "httpx-sse", drops_the_last_event)

    with pytest.raises(AssertionError, match="httpx-sse decoded the 'event' cut differently"):
        await sse_decode.measure(tokens=5, streams=1, rounds=1)


def test_sse_decode_bench_cuts_split_the_body_as_described() -> None:
    body, ends = sse_decode.stream_body(30)

    for cut in sse_decode.CUTS:
        assert b"".join(sse_decode.reads(body, ends, cut)) == body
    assert len(sse_decode.reads(body, ends, "event")) == 30 + 2  # the tokens, usage, [DONE]
    assert "日本".encode() in body  # a random cut can land mid-character
