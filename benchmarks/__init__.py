"""The benchmarks (python run.py bench, or python -m stoker.benchmarks.NAME): stoker measured as its users run it,
against baselines measured in the same run. docs/BENCHMARKS.md reads the figures."""

if __name__ != "stoker.benchmarks":  # benchmarks/ is stoker.benchmarks, under no other name
    raise ImportError(f"import stoker.benchmarks, not {__name__} (docs/DESIGN.md, Layout)")
