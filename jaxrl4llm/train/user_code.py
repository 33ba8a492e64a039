"""The user's code a run config names by import path: `reward.fn`, `algorithm.custom_loss`,
`model.module` ('package.module:function'), imported with an error that says which key is wrong."""

from __future__ import annotations

import importlib
from typing import Any

from jaxrl4llm.train.config import ConfigError


def import_object(path: str, what: str) -> Any:
    """'package.module:attr' (or 'package.module.attr') -> the object, with a clear error."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what}={path!r}: cannot import module {module_name!r} ({e}). Use 'package.module:function' "
                          f"with the module on the Python path (the working directory is).") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing (SyntaxError, NameError, ...)
        raise ConfigError(f"{what}={path!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}. "
                          f"Fix the module (JAXRL4LLM_DEBUG=1 shows the traceback).") from e
    if not hasattr(module, attr):
        raise ConfigError(f"{what}={path!r}: module {module_name!r} has no attribute {attr!r}.")
    return getattr(module, attr)
