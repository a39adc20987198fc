"""The embedding part's pieces: its texts, server arguments and report section (no server started)."""

from __future__ import annotations

import json

from qaic_bench import embedding
from qaic_bench.report import REPORT_KEYS, TITLES


def test_texts_are_mixed_lengths_and_repeatable() -> None:
    items = embedding.texts(32)
    assert items == embedding.texts(32)
    lengths = [len(t.split()) for t in items]
    assert min(lengths) <= 5 and max(lengths) >= 80


def test_server_arguments_select_the_pooling_runner() -> None:
    settings = embedding.EmbeddingSettings.quick()
    args = embedding.serve_args(settings)
    assert args[:2] == ["--runner", "pooling"]
    override = json.loads(args[args.index("--additional-config") + 1])["override_qaic_config"]
    assert override["embed_seq_len"][-1] == settings.max_model_len


def test_section_renders_the_three_rates() -> None:
    value = {
        "settings": {"num_texts": 32, "batch": 4, "buckets": [32, 128]},
        "sentence_transformers_seq_s": 100.0,
        "unpaced_seq_s": 50.0,
        "paced_bge_large_seq_s": 20.0,
        "unpaced_vs_st": 0.5,
        "paced_vs_st": 0.2,
    }
    text = "\n".join(embedding.section_lines(value))
    assert "100.0" in text and "0.50" in text and "0.20" in text
    assert "embedding" in REPORT_KEYS and "embedding" in TITLES
