"""Library notices that are not about anything longspec-jax does, kept off the terminal.

Imported first by the package, so the filters are in place before transformers is imported.
"""

import logging


def _not_the_missing_torch_notice(record: logging.LogRecord) -> bool:
    # transformers serves us tokenizers and configs only, never its PyTorch models; torch is not a
    # dependency, so its import-time "PyTorch was not found" notice would only alarm.
    return "PyTorch was not found" not in record.getMessage()


logging.getLogger("transformers").addFilter(_not_the_missing_torch_notice)
