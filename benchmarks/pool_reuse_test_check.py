"""Can `test_step_graphs_of_a_cache_reuse_each_others_temporaries_on_gpu` fail? `per-layer` gives every capture a
stream of its own (as StepGraph once did: one stream per layer), `shared` runs the code as it is:

  python benchmarks/pool_reuse_test_check.py per-layer   # expected to fail
  python benchmarks/pool_reuse_test_check.py shared

(`results/bench/pool-reuse-test-check-h100.log`)."""
import sys

import pytest
import torch

import kvcal.runtime.graph as graph

if sys.argv[1] == "per-layer":
    graph.GraphPool.stream = lambda self, device: torch.cuda.Stream(device=device)
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-s",
                      "tests/test_runtime.py::test_step_graphs_of_a_cache_reuse_each_others_temporaries_on_gpu"]))
