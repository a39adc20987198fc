"""The ``qaic-sim`` command."""


def main() -> int:
    return 0
