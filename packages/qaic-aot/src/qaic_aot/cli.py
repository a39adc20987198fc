"""The ``qaic-aot`` command."""


def main() -> int:
    return 0
