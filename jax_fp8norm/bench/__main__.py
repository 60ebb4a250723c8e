"""``python -m jax_fp8norm.bench``: the benchmark run (:mod:`jax_fp8norm.bench.cli`)."""

import sys

from jax_fp8norm.bench.cli import main

sys.exit(main())
