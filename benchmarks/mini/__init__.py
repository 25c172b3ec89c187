"""The parts of the miniature benchmark (benchmarks/miniature.py), one job per module:

- common: paths of the task's data, logging, the machine line, mean ± std formatting;
- agents: the tiny agents, the pairs (kinds of heterogeneity) and their warm starts;
- arms: the compared methods (main arms and ablations) as trainer overrides;
- runs: one run through the real trainer, its summary and the cache that lets a benchmark resume;
- stats: paired-by-seed differences, the recovered fraction and its bootstrap interval;
- report: the Markdown tables; plot: the learning curves.
"""
