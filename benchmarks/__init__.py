"""Benchmarks of cgraph against eager PyTorch, torch.compile, torch's
make_graphed_callables and a raw-CUDA-graph floor.

    python3 -m benchmarks.run            # everything (needs a CUDA device)
    python3 -m benchmarks.run --quick    # smallest sizes, few steps

* :mod:`benchmarks.workloads`: the models, their training steps and the
  variants that run them.
* :mod:`benchmarks.variant`: measures one variant of one workload, in a
  process of its own.
* :mod:`benchmarks.run`: runs every variant, prints the table, writes the
  JSON and draws the chart.
"""
