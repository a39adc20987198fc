"""CPU simulator of Qualcomm Cloud AI 100 cards with a qaicrt-compatible runtime."""

__version__ = "0.1.0"
