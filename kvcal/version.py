"""kvcal's version and the versions of what its measured numbers depend on (records import them from here; the
package re-exports both)."""

import platform

__version__ = "0.1.0"


def software_versions() -> dict:
    """The versions a measured number depends on, for its record: the same command and code gave quantized
    perplexities that differ between installations by up to 2.8% (rtn int2; fp16 by 3e-8; README, Baselines)."""
    # imported when a record is written: `import kvcal` runs this module and stays free of torch and transformers
    import numpy
    import torch
    import transformers

    versions = {"kvcal": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "numpy": numpy.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency; the record still says what it can
        pass
    return versions
