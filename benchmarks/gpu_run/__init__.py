"""The GPU-run driver (``benchmarks/gpu_speed.py`` is its entry point), kept out of the installed
package: ``session`` runs the phases with deadlines and writes the outputs; the correctness pass
against float64 (``correctness``), the compile check (``compile_check``) and the parallel cache
warm-up (``warm``). What the speed phase times is the harness's grid (``attnzoo.bench.speed_grid``:
FlashAttention's shapes, each variant's flavours, the baselines), timed and reported by the harness
(``attnzoo.bench.timing``, ``attnzoo.bench.report``); the model phase is ``attnzoo.bench.model_bench``."""
