"""The one GPU measurement (``benchmarks/gpu_speed.py`` is its entry point): ``session`` runs its
phases with deadlines; what each phase times (``cases``: the kernels at FlashAttention's shapes), the
correctness pass against float64 (``correctness``), the compile check (``compile_check``) and the
parallel cache warm-up (``warm``). The model phase is ``attnzoo.bench.model_bench``; timing and
reports are the harness's own (``attnzoo.bench.timing``, ``attnzoo.bench.report``)."""
