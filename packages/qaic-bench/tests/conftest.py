"""The benchmarks' tests run on the simulator, offline."""

from __future__ import annotations

import os

os.environ.setdefault("QAIC_BACKEND", "sim")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
