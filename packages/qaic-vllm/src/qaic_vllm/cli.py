"""The ``qaic-vllm`` command."""


def main() -> int:
    return 0
