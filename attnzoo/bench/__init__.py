"""attnzoo.bench: one benchmark harness (one timing module, one report module) for three questions.

- Kernels: time, throughput and peak memory of every variant and backend, with baselines.
  ``run(BenchConfig(...))`` returns a JSON-ready dict (see ``schema.validate``); ``write_outputs``
  writes it as JSON, Markdown and PNG plots; ``compare`` diffs two runs; ``RowLog`` keeps a JSON-lines
  log of the rows as they finish and ``load_rowlog`` rebuilds a result from it (a killed run included).
- Whole models: ``model_bench.run(ModelBenchConfig(...))``, training images/s or tokens/s of ViT-S,
  BERT, GPT-2 and a Llama-style model with each variant swapped in, eager, compiled and in CUDA graphs,
  with launches and host time per step (``write_models_outputs``).
- Per-call overhead: ``overhead.run(OverheadConfig(...))``, microseconds per fwd+bwd call at tiny
  shapes on the CPU against SDPA and timm's Attention (``write_overhead_outputs``).

One grid serves ``attnzoo bench``, the GPU measurement and the ranking tables ``auto`` reads: one
``Problem`` (``flops.Shape``, dtype, device, mode, causality), one case type (``targets.Case``: a
variant spec through one backend with a flavour of inputs; ``targets`` attnzoo's backends,
``baselines`` SDPA, FlexAttention, flash-attn, fla, torch's MultiheadAttention), one extrapolation
rule (``extrapolate``) and one row log (``rowlog``). ``runner`` plans the CLI's part of the grid,
``speed_grid`` the GPU measurement's (FlashAttention's shapes, each variant's flavours), whose rows
``ranking`` turns into the measured tables. The GPU-run driver and the README renderer are not in
the package: benchmarks/gpu_speed.py (benchmarks/gpu_run/) and benchmarks/render_readme.py. The
``attnzoo bench`` command (attnzoo/commands/bench.py) is the front end; timing is ``timing``, every
table ``report``, FLOP conventions ``flops``.
"""
from .compare import compare, markdown_compare, rich_compare
from .flops import Shape, flops
from .model_bench import ModelBenchConfig
from .output import write_models_outputs, write_outputs, write_overhead_outputs
from .overhead import OverheadConfig
from .report import markdown_report, rich_table
from .rowlog import RowLog, load_rowlog
from .runner import ALL_VARIANTS, BenchConfig, run
from .schema import load, validate

__all__ = ["ALL_VARIANTS", "BenchConfig", "ModelBenchConfig", "OverheadConfig", "RowLog", "Shape", "compare", "flops",
           "load", "load_rowlog", "markdown_compare", "markdown_report", "rich_compare", "rich_table", "run", "validate",
           "write_models_outputs", "write_outputs", "write_overhead_outputs"]
