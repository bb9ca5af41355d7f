"""airay: elastic DeepSpeed training on Ray."""

from airay.config import ConfigError, JobConfig

__all__ = ["JobConfig", "ConfigError", "fit", "Result"]
__version__ = "0.1.0"


def __getattr__(name):
    # fit and Result pull in Ray; keep `import airay` (and config validation) light.
    if name == "fit":
        from airay.api import fit

        return fit
    if name == "Result":
        from airay.controller import Result

        return Result
    raise AttributeError(name)
