"""Benchmarks behind ``omnikv bench``: each module has ``main(argv) -> int``."""
