"""The benchmarks (python run.py bench, or python -m stoker.benchmarks.NAME): stoker measured as its users run it,
against baselines measured in the same run. docs/BENCHMARKS.md reads the figures."""
