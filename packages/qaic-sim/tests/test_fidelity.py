"""The timing model against every published decode figure; the constants are the one global fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qaic_sim import cli, fidelity, timing

# Every row of section 1 of the reference (card, model, precision, tok/s).
EXPECTED = {
    ("Ultra", "Llama-2-7B", "float16", 26.49),
    ("Ultra", "Llama-2-7B", "mxfp6", 43.78),
    ("Ultra", "GPT-J-6B", "float16", 31.14),
    ("Ultra", "GPT-J-6B", "mxfp6", 50.99),
    ("Ultra", "OPT-6.7B", "float16", 19.49),
    ("Ultra", "OPT-6.7B", "mxfp6", 41.29),
    ("Ultra", "XGen-7B", "float16", 26.50),
    ("Ultra", "XGen-7B", "mxfp6", 43.46),
    ("Ultra", "OPT-2.7B", "float16", 64.17),
    ("Ultra", "OPT-2.7B", "mxfp6", 104.25),
    ("Standard", "GPT-J-6B", "float16", 8.08),
    ("Standard", "GPT-J-6B", "mxfp6", 13.9),
    ("Standard", "OPT-13B", "mxfp6", 6.98),
    ("Standard (14 NSP)", "Llama-2-7B", "float16", 7.1),
    ("Standard (14 NSP)", "Llama-2-7B", "mxfp6", 14.5),
    ("Standard (14 NSP)", "Llama-2-13B", "mxfp6", 7.0),
}
DOC = Path(__file__).resolve().parents[3] / "docs" / "simulator-timing.md"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return fidelity.fidelity_rows()


def test_every_published_row_is_computed(rows: list[dict]) -> None:
    assert {(r["card"], r["model"], r["precision"], r["published_tok_s"]) for r in rows} == EXPECTED
    assert len(rows) == len(EXPECTED)
    for r in rows:
        assert math.isfinite(r["modelled_tok_s"]) and r["modelled_tok_s"] > 0
        assert r["error_pct"] == pytest.approx(100 * (r["modelled_tok_s"] / r["published_tok_s"] - 1))


def test_median_error_target(rows: list[dict]) -> None:
    assert fidelity.median_abs_error_pct(rows) <= 15.0


def test_modelled_rate_is_decode_tokens_per_s(rows: list[dict]) -> None:
    """The table comes from the same public entry point the runtime uses."""
    for r, published in zip(rows, fidelity.PUBLISHED, strict=True):
        rate = timing.decode_tokens_per_s(
            fidelity.MODELS[r["model"]],
            sku=published.sku,
            num_devices=r["num_devices"],
            num_cores=r["num_cores"],
            batch=fidelity.BATCH,
            ctx_len=fidelity.CTX_LEN,
            prompt_len=fidelity.PROMPT_LEN,
            gen_len=fidelity.GEN_LEN,
            weight_precision=r["precision"],
            kv_precision=fidelity.KV_PRECISION,
        )
        assert rate == pytest.approx(r["modelled_tok_s"])


def test_constants_are_the_global_fit() -> None:
    bw, e1 = fidelity.fit_constants()
    assert bw == pytest.approx(timing.BANDWIDTH_EFFICIENCY, rel=0.02)
    assert e1 == pytest.approx(timing.BATCH1_COMPUTE_EFFICIENCY, rel=0.02)


def test_rows_support_no_fixed_costs() -> None:
    """Refitting with a launch overhead or a per-collective latency only makes the fit worse."""
    best = fidelity.fit()[0]
    assert best < fidelity.fit(launch_overhead_s=0.5e-3)[0]
    assert best < fidelity.fit(p2p_latency_s=20e-6)[0]
    assert timing.LAUNCH_OVERHEAD_S == 0.0 and timing.P2P_LATENCY_S == 0.0


def test_fit_holds_out_of_sample() -> None:
    """Leave-one-out: every row predicted by constants fitted without it still meets the target."""
    assert fidelity.median_abs_error_pct(fidelity.leave_one_out_rows()) <= 15.0


def test_ultra_rows_need_the_whole_card(rows: list[dict]) -> None:
    """No single SoC can stream the weights fast enough for any published Ultra rate."""
    for published in fidelity.PUBLISHED:
        if published.card == "Ultra":
            assert published.tok_s > fidelity.one_soc_bound_tok_s(published)
    one_soc = fidelity.fidelity_rows(ultra_devices=1)
    assert fidelity.median_abs_error_pct(one_soc) > 50 > fidelity.median_abs_error_pct(rows)


def test_mxfp6_beats_fp16_and_bandwidth_helps(rows: list[dict]) -> None:
    by_key = {(r["card"], r["model"], r["precision"]): r["modelled_tok_s"] for r in rows}
    pairs = [
        (k, by_key[(*k[:2], "float16")]) for k in by_key if k[2] == "mxfp6" and (*k[:2], "float16") in by_key
    ]
    assert len(pairs) == 7
    assert all(by_key[k] > fp16 for k, fp16 in pairs)
    faster = fidelity.fidelity_rows(bandwidth_efficiency=timing.BANDWIDTH_EFFICIENCY * 1.2)
    assert all(f["modelled_tok_s"] >= r["modelled_tok_s"] for f, r in zip(faster, rows, strict=True))
    assert all(
        f["modelled_tok_s"] > r["modelled_tok_s"]
        for f, r in zip(faster, rows, strict=True)
        if r["precision"] == "float16"
    )


def test_docs_table_is_current(rows: list[dict]) -> None:
    """docs/simulator-timing.md carries the table this code generates."""
    if not DOC.is_file():
        pytest.skip("docs are not part of this checkout")
    assert fidelity.markdown_table(rows) in DOC.read_text()


def test_cli_prints_the_table_and_the_rows_as_json(
    rows: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    """``qaic-sim fidelity [--json]``: what tools (the benchmarks) read instead of importing this module."""
    assert cli.main(["fidelity", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == rows
    assert cli.main(["fidelity"]) == 0
    assert fidelity.markdown_table(rows) in capsys.readouterr().out
