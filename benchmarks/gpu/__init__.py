"""The pieces of benchmarks/gpu_speed.py: what is timed (cases), how (timing), the correctness pass
against float64, training throughput, the compile check, parallel cache warming and the report."""
