"""Accelerator-only benchmarking (see tokamax/_src/benchmarking.py)."""

from tokamax._src.benchmarking import (
    BenchmarkData,
    CompiledBenchmark,
    benchmark,
    compile_benchmark,
    standardize_function,
)

__all__ = [
    "BenchmarkData",
    "CompiledBenchmark",
    "benchmark",
    "compile_benchmark",
    "standardize_function",
]
